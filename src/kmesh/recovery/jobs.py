"""What a request asks of recovery, and what recovery reports: the same in both engines.

A request that declares segments and a RecoverySpec (kmesh.state.request_meta) is handed to
kmesh.recovery.requests.RequestRecovery as a RecoveryJob: fill its rows [start, end) after
its exact prefix (vLLM's local prefix hit, or the reference engine's). vLLM's connector builds the
job in its scheduler half and runs it in its worker half; the reference engine builds and runs it
in its runner. Each engine reads a job's exact prefix back from its own pages (a PrefixReader).
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kmesh.compute.config import ModelConfig
from kmesh.errors import InvalidRequestError
from kmesh.kv.master_mirror import Master, Mirror
from kmesh.recovery.check_layer import check_layer_for
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.state.segments import Span


@dataclass(frozen=True, slots=True)
class RecoveryJob:
    """Fill the request's rows [start, end) by recovery (kmesh/recovery/requests.py); the
    engine computes the rest of the prompt after them."""

    request_id: str
    token_ids: list[int]  # the whole prompt
    block_ids: list[int]
    start: int  # the local prefix hit: rows [0, start) are exact KV already in the pages
    end: int
    tenant: str | None  # cache_salt: the namespace of the stored segment KV
    spans: list[Span]  # the prompt's segments (empty without segments)
    spec: RecoverySpec
    family: str | None

    def round_spans(self) -> list[Span]:
        """The round's segments in this prompt, in the round's canonical order."""
        assert self.spec.round is not None
        by_id = {span.segment_id: span for span in self.spans}
        return [by_id[segment_id] for segment_id in self.spec.round.segments]


class PrefixReader(Protocol):
    """An engine's pages: the exact KV of a request's rows."""

    def read(
        self, block_ids: Sequence[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, n, kv_heads, head_dim] of the request's rows at `positions` [n]."""
        ...


@dataclass(frozen=True, slots=True)
class RoundKey:
    """A round's siblings and master: one round of one family in one tenant's namespace."""

    tenant: str | None
    family: str
    round_id: str


@dataclass(frozen=True, slots=True, eq=False)  # tensor fields: no value equality
class RoundMirrors:
    """A round job's mirrors of its round's master (kmesh/kv/master_mirror.py): its rows of the
    round's segments as the master's, placed and corrected; what shares them beyond the engine
    names the master by round, how it was built and its segments' tokens."""

    round: RoundKey
    master_choice: str
    tokens: tuple[int, ...]  # the round's segments' tokens, in canonical order
    master: Master
    mirrors: tuple[Mirror, ...]
    # A mirror lying wholly at or after this position restores the rows the job wrote, bit for
    # bit: its diff was taken from those rows (collective.recover_siblings). None: not known
    # (the master sibling's keys turn by 0, which need not keep -0.0); a publisher checks.
    gives_back_from: int | None = None


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What recovering one request cost and how far it was from exact."""

    computed_tokens: float  # token-layers / layers, by KMesh's executor for this request
    shared_computed_tokens: float  # a round's master, paid by the sibling that built it
    master_bytes: int  # the size of the master this request built (kept by the worker), else 0
    mirror_bytes: int  # its mirrors: indices + the block-sparse diff against the master
    reused_tokens: int  # claimed tokens whose KV came from stored segment KV (re-rotated)
    deviation: float | None  # mean relative key deviation at the check layer, if computed
    fell_back: bool  # the gate sent the claimed tokens back to the engine's own prefill
    # claimed rows taken as they were from a kept tail continuing the prefix (prefix_tails.py)
    tail_tokens: int = 0
    # claimed rows restored from the store: the transcript another job published
    # (recovery/shared.py), and the bytes read for them
    restored_tokens: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True, slots=True)
class RecoveredRows:
    """What recovering one job gave: its report and the rows to write."""

    report: RecoveryReport
    # Rows [start, end) to write, None when the gate left them to the engine's own prefill (and
    # in what RequestRecovery.run returns: the writer had them).
    k: torch.Tensor | None
    v: torch.Tensor | None
    mirrors: RoundMirrors | None = None  # a round job's, for publishing its transcript
    # Shared-state keys of the entries the job's next prompt reads (its transcript's pieces and
    # master), once published: what the engine pins for a declared next use.
    transcript: tuple[bytes, ...] = ()


# Writes a job's outcome into the engine's pages (rows [start, end), unless the gate left them);
# recovery lets go of the rows after the call (a writer that keeps a view keeps its whole batch).
Writer = Callable[[RecoveryJob, RecoveredRows], None]


@dataclass(frozen=True, slots=True)
class RecoveryRequest:
    """What a request declares for recovery (the reference engine's Request.recovery)."""

    spans: tuple[Span, ...]  # its segments, spelling its prompt
    spec: RecoverySpec
    family: str | None

    def check(self, num_prompt: int, config: ModelConfig) -> None:
        """Refuse (InvalidRequestError) spans that are not in order within a prompt of
        `num_prompt` tokens, a check layer the model has not, and a round without a family,
        naming a segment no span has, or whose segments do not lie side by side in
        the prompt (a round's master is mirrored as one run of its segments)."""
        end = 0
        for span in self.spans:
            if not end <= span.start < span.end <= num_prompt:
                raise InvalidRequestError(
                    f"recovery span [{span.start}, {span.end}) is empty, out of order or outside "
                    f"the prompt of {num_prompt} tokens"
                )
            end = span.end
        if self.spec.check_layer is not None:
            try:
                check_layer_for(self.spec.check_layer, config)
            except ValueError as error:
                raise InvalidRequestError(f"kmesh.recovery.check_layer: {error}") from None
        round_ = self.spec.round
        if round_ is None:
            return
        if self.family is None:
            raise InvalidRequestError("a recovery round needs a family (its rounds share state)")
        named = {span.segment_id: span for span in self.spans}
        missing = [i for i in round_.segments if i not in named]
        if missing:
            raise InvalidRequestError(f"the round names segment ids no span has: {missing}")
        placed = sorted((named[i] for i in round_.segments), key=lambda span: span.start)
        for before, after in itertools.pairwise(placed):
            if after.start != before.end:
                raise InvalidRequestError(
                    f"the round's segments {before.segment_id!r} and {after.segment_id!r} are "
                    f"not side by side in the prompt (tokens [{before.end}, {after.start}) lie "
                    "between them): put the round's segments next to each other"
                )
