"""KMesh's strategies of `kmesh bench capacity`: All-Gather rounds whose members' transcripts live
in a store of a fixed size between rounds, restored from it each round.

One run replays one trace (workloads/allgather.py) with the reference executor, in rounds:
1. restore: each member's transcript (its previous prompt minus the instruction) is read back from
   the store as its chain of pieces (store/group_state.py): the family trunk, the member's
   private rows, then one piece per earlier round. From the first piece the store lost on
   (evicted, corrupted: its checksum, or not bit-identical: its digest), the rest is computed
   (exact prefill after what was restored) and published again as dense pieces. A store that
   is gone is used no more: every transcript is computed.
2. the round: recovery/collective.py, the master from the first member (computed exactly), the
   others mirrored from it (corrected as `recovery` says), the instruction computed.
3. publish: each member's new piece (the round's outputs in its prompt), declared for its next
   use, and the round's master once.

Layouts (`layout`): "mirror" publishes a member's piece as its mirrors of the round's master
(the master stored once for all), "dense" as its rows. Retention: the store's `future_use`
(every piece pinned for the council with its next use: the member's place in the next round;
masters and the trunk at the next round's start) or `lru` (nothing declared). Members go through
each step `chunk` at a time, so that memory holds a few transcripts, not all. Trajectories
(`collective` False: workloads/trajectory.py, a turn is a round) only append: each turn's prompt
after the transcript is computed, and pieces are dense.

Accounting: computed tokens are token-layers / layers, split into what the round itself needs
(`round_computed`) and what lost pieces cost (`recomputed`); seconds are wall time of restore,
recovery and recompute; `bytes_restored` is what restores read (pieces and masters); `held_bytes`
the store's bytes after the round; `transcript_bytes` a member's transcript in this layout with
the trunk and masters counted once over all members (`own_bytes`: its own pieces only).
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.allgather.inputs import RecoveryInputs, Transcript, region_segments
from kmesh.bench.capacity.store import FAMILY, PieceStore, RoundStats
from kmesh.compute.executor import DenseKV, Executor
from kmesh.kv.master_mirror import Master
from kmesh.recovery.collective import MASTER_BLOCK, blank_kv, recover_round
from kmesh.recovery.recover import RecoveryConfig, RegionInput, recover
from kmesh.state.keys import KeyNamespace, piece_key, segment_key
from kmesh.store.shared.group_state import Piece, master_payload, piece_payload
from kmesh.workloads.allgather import AgentTurn

COMPUTE_ALL = RecoveryConfig("full", 1.0)
LAYOUTS = ("mirror", "dense")


@dataclass(slots=True)
class _Member:
    keys: list[bytes] = field(default_factory=list)  # its chain of pieces, the trunk first
    tokens: list[tuple[int, ...]] = field(default_factory=list)  # each piece's tokens
    own_bytes: list[int] = field(default_factory=list)  # each piece's bytes (0: the trunk)


class GroupStateRun:
    """One KMesh strategy over one trace's rounds: its `layout` and whether pieces are
    `declare`d for their next use (the store's retention acts on it)."""

    def __init__(
        self,
        executor: Executor,
        fingerprint: str,
        rounds: Sequence[Sequence[AgentTurn]],
        store: str,
        layout: str,
        declare: bool,
        recovery: RecoveryConfig | None = None,
        collective: bool = True,
        chunk: int = 4,
    ) -> None:
        """`recovery`: the mirrored members' (default: the All-Gather bench's, agent ratio 0:
        kv_deviation with the gate at 0.1 on 1/8 of the tokens)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.executor = executor
        self.rounds = rounds
        self.agents = len(rounds[0])
        self.layout = layout
        self.collective = collective
        self.chunk = chunk
        self.cfg = recovery or AllGatherBenchConfig().recovery(0.0)
        self.inputs = RecoveryInputs(executor, fingerprint, self.agents, MASTER_BLOCK)
        self.namespace = KeyNamespace(fingerprint, tenant_salt="kmesh-approx")
        self.store = PieceStore(store, executor.config, declare)
        self.members = [_Member() for _ in range(self.agents)]
        self._shared_bytes = 0  # the trunk and every master, once
        self._trunk: Transcript | None = None
        self._trunk_key = b""
        self.master_keys: list[bytes] = []

    def run(self) -> list[RoundStats]:
        """Every round, in order."""
        try:
            return [self.round(r) for r in range(len(self.rounds))]
        finally:
            self.close()

    def close(self) -> None:
        self.store.close()

    # -- one round ---------------------------------------------------------------------------

    def round(self, r: int) -> RoundStats:
        """Round r (the earlier ones done)."""
        stats = RoundStats()
        turns = self.rounds[r]
        master: Master | None = None
        for lo in range(0, self.agents, self.chunk):
            chunk = turns[lo : lo + self.chunk]
            started = time.perf_counter()
            if r == 0:
                pieces = [self._first_round(turn, stats) for turn in chunk]
            elif self.collective:
                transcripts = [self._restore(turn, stats) for turn in chunk]
                pieces, master = self._collective(r, chunk, transcripts, master, stats)
            else:
                transcripts = [self._restore(turn, stats) for turn in chunk]
                pieces = self._appended(chunk, transcripts, stats)
            for turn, piece in zip(chunk, pieces, strict=True):
                self._extend(turn, piece, r)
            stats.seconds += time.perf_counter() - started
        # The trunk and the masters: read by every member from the next round's start on.
        self.store.declare_use(
            [self._trunk_key, *self.master_keys], self._round_start(r + 1), stats
        )
        stats.held_bytes = self.store.used_bytes(stats)
        stats.own_bytes = sum(sum(m.own_bytes) for m in self.members) / self.agents
        stats.transcript_bytes = stats.own_bytes + self._shared_bytes / self.agents
        return stats

    def _first_round(self, turn: AgentTurn, stats: RoundStats) -> Piece:
        """Round 0: the prompt after the trunk (private rows, the instruction) computed."""
        trunk = self._trunk or self._publish_trunk(stats)
        region = self.inputs.new_region(turn.prompt.segments[1:], trunk, len(trunk.token_ids))
        out = recover(self.executor, [region], COMPUTE_ALL)[0]
        stats.round_computed += out.computed_tokens
        held = _held_end(turn) - len(trunk.token_ids)
        return Piece.of(len(trunk.token_ids), out.k[:, :held], out.v[:, :held])

    def _collective(
        self,
        r: int,
        turns: Sequence[AgentTurn],
        transcripts: Sequence[Transcript],
        master: Master | None,
        stats: RoundStats,
    ) -> tuple[list[Piece], Master]:
        """The round's members of this chunk through collective recovery; the master, built
        by the round's first member, published once when pieces mirror it (dense pieces need
        it during the round only)."""
        key = self._master_key(r)
        siblings = [self.inputs.sibling(r, t, x) for t, x in zip(turns, transcripts, strict=True)]
        result = recover_round(self.executor, siblings, self.cfg, MASTER_BLOCK, master)
        if result.built and self.layout == "mirror":
            payload = master_payload(result.master)
            self._shared_bytes += payload[0]
            self.master_keys.append(key)
            self.store.publish(key, payload, self._round_start(r + 1))
        pieces = []
        for turn, sibling, out in zip(turns, siblings, result.siblings, strict=True):
            stats.round_computed += out.recovered.computed_tokens
            held = _held_end(turn) - sibling.start
            k, v = out.recovered.k[:, :held], out.recovered.v[:, :held]
            mirrored = self.layout == "mirror" and not out.recovered.fell_back
            mirrors = out.mirrors if mirrored else ()  # a gated member is its own rows
            pieces.append(Piece.of(sibling.start, k, v, mirrors, key))
        return pieces, result.master

    def _appended(
        self, turns: Sequence[AgentTurn], transcripts: Sequence[Transcript], stats: RoundStats
    ) -> list[Piece]:
        """Turns that only append (trajectories): the prompts after the transcripts computed."""
        regions = [
            self.inputs.new_region(region_segments(t, x), x, len(x.token_ids))
            for t, x in zip(turns, transcripts, strict=True)
        ]
        pieces = []
        for turn, region, out in zip(
            turns, regions, recover(self.executor, regions, COMPUTE_ALL), strict=True
        ):
            stats.round_computed += out.computed_tokens
            start = int(region.positions[0])
            held = _held_end(turn) - start
            pieces.append(Piece.of(start, out.k[:, :held], out.v[:, :held]))
        return pieces

    def _extend(self, turn: AgentTurn, piece: Piece, r: int) -> None:
        """Publish the member's new piece (its held rows of round r) at the end of its chain."""
        member = self.members[turn.agent]
        tokens = turn.prompt.token_ids[piece.start : piece.end]
        if not member.keys:
            trunk = self._trunk
            assert trunk is not None
            member.keys.append(piece_key(self.namespace, None, trunk.token_ids))
            member.tokens.append(trunk.token_ids)
            member.own_bytes.append(0)
        member.keys.append(piece_key(self.namespace, member.keys[-1], tokens))
        member.tokens.append(tokens)
        payload = piece_payload(piece)
        member.own_bytes.append(payload[0])
        self.store.publish(member.keys[-1], payload, self._next_use(turn.agent, r))

    # -- restore -----------------------------------------------------------------------------

    def _restore(self, turn: AgentTurn, stats: RoundStats) -> Transcript:
        """The member's transcript from the store: its pieces up to the first one lost, the
        rest computed after them and published again."""
        member = self.members[turn.agent]
        ks, vs = self.store.restore(member.keys, stats)
        if len(ks) < len(member.keys):
            stats.pieces_lost += len(member.keys) - len(ks)
            self._recompute(member, ks, vs, stats)
        self.store.declare_use(member.keys[1:], self._next_use(turn.agent, turn.round), stats)
        tokens = tuple(t for piece in member.tokens for t in piece)
        return Transcript(tokens, torch.cat(ks, dim=1), torch.cat(vs, dim=1))

    def _recompute(
        self, member: _Member, ks: list[torch.Tensor], vs: list[torch.Tensor], stats: RoundStats
    ) -> None:
        """The member's pieces from len(ks) on computed exactly after the restored ones
        (appended to ks, vs) and published again, dense."""
        first = len(ks)
        start = sum(len(t) for t in member.tokens[:first])
        prefix = None
        if ks:
            prefix = DenseKV(torch.arange(start), list(torch.cat(ks, 1)), list(torch.cat(vs, 1)))
        tokens = torch.tensor([t for piece in member.tokens[first:] for t in piece])
        out = recover(self.executor, [_computed(self.executor, tokens, start, prefix)], COMPUTE_ALL)
        stats.recomputed += out[0].computed_tokens
        offset = 0
        for i in range(first, len(member.keys)):
            n = len(member.tokens[i])
            k, v = out[0].k[:, offset : offset + n], out[0].v[:, offset : offset + n]
            payload = piece_payload(Piece.of(start + offset, k, v))
            if i > 0:  # the trunk stays shared
                member.own_bytes[i] = payload[0]
            self.store.publish(member.keys[i], payload, None, replace=True)
            ks.append(k)
            vs.append(v)
            offset += n

    # -- publish -----------------------------------------------------------------------------

    def _publish_trunk(self, stats: RoundStats) -> Transcript:
        """The family trunk (the system prompt), computed once: one entry for every member."""
        system = self.rounds[0][0].prompt.segments[0]
        out = recover(self.executor, [self.inputs.new_region([system], None, 0)], COMPUTE_ALL)
        stats.round_computed += out[0].computed_tokens
        payload = piece_payload(Piece.of(0, out[0].k, out[0].v))
        self._shared_bytes += payload[0]
        self._trunk_key = piece_key(self.namespace, None, system.token_ids)
        self.store.publish(self._trunk_key, payload, 0.0)
        self._trunk = Transcript(system.token_ids, out[0].k, out[0].v)
        return self._trunk

    def _master_key(self, r: int) -> bytes:
        """Round r's master: the tokens of round r - 1's outputs, in author order."""
        prompt = self.rounds[r][0].prompt
        by_author = {self.inputs.author(r, s): s.token_ids for s in prompt.segments}
        tokens = [t for a in range(self.agents) for t in by_author[a]]
        return segment_key(self.namespace, tokens, f"{FAMILY}-master-{r}")

    def _next_use(self, agent: int, r: int) -> float:
        """When member `agent` reads its transcript next: its place in round r + 1."""
        return float(self._round_start(r + 1) + agent)

    def _round_start(self, r: int) -> int:
        return r * self.agents


def _held_end(turn: AgentTurn) -> int:
    """Where the member's transcript ends: its prompt minus the instruction."""
    return len(turn.prompt.token_ids) - len(turn.prompt.segments[-1].token_ids)


def _computed(
    executor: Executor, tokens: torch.Tensor, start: int, prefix: DenseKV | None
) -> RegionInput:
    """Tokens at start.. to compute in full after `prefix`."""
    n = len(tokens)
    blank = blank_kv(executor, n)
    nothing = torch.zeros(n, dtype=torch.bool)
    return RegionInput(
        tokens, torch.arange(start, start + n), prefix, blank, blank, nothing, nothing.long()
    )
