"""Recovery inputs for an All-Gather trace's prompts, and the round outputs' stored KV they reuse.

Every output is stored once, as its author's generation leaves it: computed after the author's
full prompt (`store_outputs`). A reader's prompt finds it by its tokens in a segment index
(`output_reuse`): the stored KV on the generated tokens, nothing on the header and closing tokens
around them (those were not in the author's context and are computed). Regions start after an
agent's transcript (its previous prompt minus the instruction):
- `new_region`: nothing reusable, computed in full;
- `reuse_region`: per-request reuse, the previous round's outputs placed at the reader's positions;
- `sibling`: collective reuse, the region and where the previous round's outputs lie in it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.index.segment_index import AUTHOR, SegmentIndex
from kmesh.kv.block_pool import blocks_for
from kmesh.kv.segment_kv import SegmentKV
from kmesh.recovery.collective import SiblingInput, blank_kv
from kmesh.recovery.common_master import SharedSegment
from kmesh.recovery.recover import Recovered, RegionInput
from kmesh.state.keys import KeyNamespace
from kmesh.state.segments import Segment
from kmesh.workloads.allgather import AgentTurn, output_segment_id


@dataclass(slots=True)
class Transcript:
    """An agent's exact context so far (its prompt minus the instruction) and that KV."""

    token_ids: tuple[int, ...]
    k: torch.Tensor  # [layers, p, kv_heads, head_dim]
    v: torch.Tensor
    reused: torch.Tensor | None = None  # [p] bool: rows whose KV was reused (None: none were)

    def context(self) -> DenseKV:
        return DenseKV(torch.arange(len(self.token_ids)), list(self.k), list(self.v))

    def extend(
        self, turn: AgentTurn, recovered: Recovered
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The turn's whole prompt (k, v, reused rows): this transcript, then the region it
        recovered; the transcript becomes the prompt minus its final segment (the instruction)."""
        k = torch.cat((self.k, recovered.k), dim=1)
        v = torch.cat((self.v, recovered.v), dim=1)
        before = self.reused
        if before is None:
            before = torch.zeros(self.k.shape[1], dtype=torch.bool)
        reused = torch.cat((before, recovered.reused))
        keep = len(turn.prompt.token_ids) - len(turn.prompt.segments[-1].token_ids)
        self.token_ids = turn.prompt.token_ids[:keep]
        self.k, self.v, self.reused = k[:, :keep], v[:, :keep], reused[:keep]
        return k, v, reused


def region_segments(turn: AgentTurn, transcript: Transcript) -> list[Segment]:
    """The prompt's segments after the agent's transcript (its previous prompt minus ask)."""
    p = len(transcript.token_ids)
    if turn.prompt.token_ids[:p] != transcript.token_ids:
        raise ValueError(
            f"agent {turn.agent}'s round-{turn.round} prompt does not extend its transcript"
        )
    spans = turn.prompt.spans
    first = next(i for i, span in enumerate(spans) if span.start == p)
    return list(turn.prompt.segments[first:])


class RecoveryInputs:
    """The outputs' stored KV of one trace (`agents` per round) and the regions built on it;
    KV bytes are counted in whole blocks of `block_size` tokens."""

    def __init__(self, executor: Executor, fingerprint: str, agents: int, block_size: int) -> None:
        self.executor = executor
        self.agents = agents
        self.block_size = block_size
        self.index: SegmentIndex[SegmentKV] = SegmentIndex(KeyNamespace(fingerprint))
        model = executor.config
        element = torch.empty((), dtype=executor.dtype).element_size()
        self.block_bytes = (
            2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element
        )

    @property
    def config(self) -> ModelConfig:
        return self.executor.config

    def new_region(
        self, segments: Sequence[Segment], transcript: Transcript | None, start: int
    ) -> RegionInput:
        """A region with nothing reusable: computed in full."""
        tokens = torch.tensor([t for s in segments for t in s.token_ids])
        n = len(tokens)
        blank = blank_kv(self.executor, n)
        return RegionInput(
            tokens,
            torch.arange(start, start + n),
            None if transcript is None else transcript.context(),
            blank,
            blank,
            torch.zeros(n, dtype=torch.bool),
            torch.zeros(n, dtype=torch.int64),
        )

    def reuse_region(self, r: int, turn: AgentTurn, transcript: Transcript) -> RegionInput:
        """Per-request reuse: the round's outputs from their authors' KV, at the agent's offsets."""
        segments = region_segments(turn, transcript)
        start = len(transcript.token_ids)
        ks, vs, reusable, segment_of = [], [], [], []
        position = start
        for index, segment in enumerate(segments):
            n = len(segment.token_ids)
            author = self.author(r, segment)
            if author is None:
                k = v = blank_kv(self.executor, n)
                mask = torch.zeros(n, dtype=torch.bool)
            else:
                shared = self.output_reuse(r - 1, author, turn)
                k, v = shared.stored.placed(torch.arange(position, position + n), self.config)
                mask = shared.reusable
            ks.append(k)
            vs.append(v)
            reusable.append(mask)
            segment_of.append(torch.full((n,), index))
            position += n
        tokens = torch.tensor([t for s in segments for t in s.token_ids])
        return RegionInput(
            tokens,
            torch.arange(start, position),
            transcript.context(),
            torch.cat(ks, dim=1),
            torch.cat(vs, dim=1),
            torch.cat(reusable),
            torch.cat(segment_of),
        )

    def author(self, r: int, segment: Segment) -> int | None:
        """The agent whose round r - 1 output `segment` of a round-r prompt is, if any."""
        if r == 0:
            return None
        for author in range(self.agents):
            if segment.segment_id == output_segment_id(r - 1, author):
                return author
        return None

    def output_reuse(self, r: int, author: int, reader: AgentTurn) -> SharedSegment:
        """Round r's output of `author` as read in `reader`'s prompt: its stored (author-context)
        KV on the generated tokens, nothing on the header and closing tokens (nor on an output
        too short for the index to find inside a segment: computed)."""
        wanted = output_segment_id(r, author)
        segment = next(s for s in reader.prompt.segments if s.segment_id == wanted)
        tokens = segment.token_ids
        n = len(tokens)
        k = blank_kv(self.executor, n)
        v = blank_kv(self.executor, n)
        found = self.index.find_within(tokens, AUTHOR)
        if found is None:
            return SharedSegment(
                torch.tensor(tokens), SegmentKV(k, v), torch.zeros(n, dtype=torch.bool)
            )
        offset, entry = found
        body, stored = entry.token_ids, entry.value
        body_k, body_v = stored.placed(torch.arange(offset, offset + len(body)), self.config)
        k[:, offset : offset + len(body)] = body_k
        v[:, offset : offset + len(body)] = body_v
        reusable = torch.zeros(n, dtype=torch.bool)
        reusable[offset : offset + len(body)] = True
        return SharedSegment(torch.tensor(tokens), SegmentKV(k, v), reusable)

    def sibling(self, r: int, turn: AgentTurn, transcript: Transcript) -> SiblingInput:
        """The agent's round-r prompt after its transcript, with where round r - 1's outputs lie
        (in author order: the round's canonical order)."""
        segments = region_segments(turn, transcript)
        where = {
            segment.segment_id: (span.start, span.end)
            for segment, span in zip(turn.prompt.segments, turn.prompt.spans, strict=True)
        }
        return SiblingInput(
            torch.tensor([t for s in segments for t in s.token_ids]),
            len(transcript.token_ids),
            transcript.context(),
            [where[output_segment_id(r - 1, a)] for a in range(self.agents)],
        )

    def store_outputs(self, r: int, turns: Sequence[AgentTurn], recovered: list[Recovered]) -> None:
        """Each output's KV computed after its author's prompt, as generation leaves it."""
        batch = []
        for turn, rec in zip(turns, recovered, strict=True):
            n = len(turn.prompt.token_ids)
            context = DenseKV(torch.arange(n), list(rec.k), list(rec.v))
            positions = torch.arange(n, n + len(turn.output_ids))
            batch.append(SequenceInput(torch.tensor(turn.output_ids), positions, context))
        for turn, item, out in zip(turns, batch, self.executor.forward(batch), strict=True):
            k, v = torch.stack(out.k), torch.stack(out.v)
            stored = SegmentKV.canonical(k, v, item.positions, self.config)
            self.index.put(turn.output_ids, AUTHOR, r, stored)

    def dense_output_bytes(self, reader: AgentTurn, r: int) -> int:
        """A dense copy of the outputs round r's prompts hold (`reader` is one of them), in whole
        blocks (each output starts a block)."""
        lengths = [
            len(s.token_ids) for s in reader.prompt.segments if self.author(r, s) is not None
        ][-self.agents :]
        bs = self.block_size
        return sum(blocks_for(n, bs) for n in lengths) * self.block_bytes
