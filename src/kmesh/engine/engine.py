"""The reference engine: requests in, completions out, over one executor and a paged KV cache.

Exact sharing happens two ways, both by reference to the same physical blocks: the prefix index
(full blocks a request happens to share with earlier ones) and forks (a branch declared to start
from a retained state, which shares every block, copies the partly filled last one on its first
write, and samples its first token from the parent's held logits).

Requests may run under LoRA adapters loaded into the engine, several in one batch; what state
they may share is engine/adapters.py's rule.
"""

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.context import Context, resolve_context
from kmesh.compute.executor import Executor
from kmesh.compute.lora import LoraAdapter
from kmesh.coord.families import FamilyRegistry
from kmesh.engine.adapters import Adapters
from kmesh.engine.checks import check_request
from kmesh.engine.generation import finish_reason, request_output, sample_into
from kmesh.engine.kv_manager import KVCacheManager
from kmesh.engine.prompt_logprobs import take_held
from kmesh.engine.request import Request, RequestOutput, TopLogprobs
from kmesh.engine.retained import RetainedStates
from kmesh.engine.runner import ModelRunner
from kmesh.engine.scheduler import ScheduledBatch, Scheduler
from kmesh.engine.sequence import Sequence
from kmesh.engine.store_link import StoreLink
from kmesh.errors import ContractError, InvalidRequestError, OutOfBlocksError
from kmesh.kv.block_pool import blocks_for
from kmesh.kv.kv_cache import PagedKVCache
from kmesh.recovery.quality import resolve_quality
from kmesh.recovery.requests import DEFAULT_RECOVERY_BYTES
from kmesh.state.recovery_meta import recovery_refusal

# How long a step waits when every waiting request waits for another engine's blocks.
STORE_POLL_S = 0.02
# The KV pool's defaults: tokens per block, and its capacity in tokens.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_TOKENS = 16384


@dataclass(slots=True)
class EngineCounters:
    # Token positions run through the model, every kind (prefill, decode, recomputation).
    computed_tokens: int = 0
    # Most blocks held by live or retained sequences at once (cached free blocks not counted).
    peak_blocks_in_use: int = 0


def reference_context(
    config: ModelConfig,
    max_model_len: int | None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
) -> Context:
    """The reference engine's context (kmesh/compute/context.py): `max_model_len` when it fits,
    else the model's bounded by its KV pool, in whole blocks. Read from the description alone,
    so a caller can refuse before the weights load."""
    pool = blocks_for(kv_cache_tokens, block_size) * block_size
    return resolve_context(config, max_model_len, pool)


class Engine:
    """Batches requests step by step; shares exact state through the prefix index and forks.

    Args:
        executor: the model.
        model_fingerprint: the `model` part of every state key (see compute.loader).
        block_size: tokens per KV block; prefix sharing works in whole blocks.
        kv_cache_tokens: capacity of the KV pool in tokens (rounded up to whole blocks).
        max_batch_tokens: tokens computed per step at most (a longer prompt runs alone).
        max_seqs: sequences running at once at most.
        prefix_caching: reuse full blocks across requests by key (forks share regardless).
        store: socket of a `kmesh store serve` process: prompt blocks the local cache misses are
            restored from it, and blocks this engine computes first are published to it.
        adapters: LoRA adapters requests may name (`Request.adapter`), by their names.
        recovery_bytes: what recovery keeps (stored segments, masters) at most.
        max_model_len: the context, prompt and output together (None: the model's, bounded by
            the KV pool: reference_context).
    """

    def __init__(
        self,
        executor: Executor,
        model_fingerprint: str,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
        max_batch_tokens: int = 4096,
        max_seqs: int = 32,
        prefix_caching: bool = True,
        store: str | None = None,
        adapters: Iterable[LoraAdapter] = (),
        decode: Callable[[list[int]], str] | None = None,
        recovery_bytes: int = DEFAULT_RECOVERY_BYTES,
        max_model_len: int | None = None,
    ) -> None:
        """`decode`: token ids to text (the tokenizer's), for requests with stop strings."""
        if block_size < 1 or kv_cache_tokens < block_size:
            raise InvalidRequestError(
                f"block_size ({block_size}) must be >= 1 and kv_cache_tokens "
                f"({kv_cache_tokens}) at least one block"
            )
        self.executor = executor
        self.fingerprint = model_fingerprint
        self.config = executor.config
        self.decode = decode
        self.adapters = Adapters(adapters)
        num_blocks = blocks_for(kv_cache_tokens, block_size)
        self.context = reference_context(self.config, max_model_len, block_size, kv_cache_tokens)
        self.cache = PagedKVCache(self.config, num_blocks, block_size, executor.dtype)
        if store is not None and not prefix_caching:
            raise InvalidRequestError("a store needs prefix caching (it shares blocks by key)")
        self._link = None
        if store is not None:
            self._link = StoreLink.open(store, self.cache, model_fingerprint, self.config)
        # Exact blocks: what the local cache misses is restored from the store, and published.
        self.store = None if self._link is None else self._link.blocks
        self.kv = KVCacheManager(
            num_blocks, block_size, model_fingerprint, prefix_caching, self.store
        )
        self.scheduler = Scheduler(self.kv, max_batch_tokens, max_seqs)
        shared = None if self._link is None else self._link.shared
        self.runner = ModelRunner(executor, self.cache, model_fingerprint, recovery_bytes, shared)
        self.families = FamilyRegistry()
        self.counters = EngineCounters()
        # Outputs of requests that ended since the last step() returned.
        self._ended: list[RequestOutput] = []
        self._live_ids: set[str] = set()
        self._states = RetainedStates(self.adapters)

    def close(self) -> None:
        """Close the store connections, if any (they reopen on the next use)."""
        if self._link is not None:
            self._link.close()

    @property
    def kv_bytes_per_block(self) -> int:
        return self.cache.bytes_per_block

    def declare_family(self, family_id: str, trunk_id: str, num_branches: int) -> None:
        """Declare that `num_branches` branches will fork `trunk_id` (computed or not yet): the
        trunk stays pinned until they have all ended or the family is closed."""
        self.families.declare(family_id, trunk_id, num_branches)

    def close_family(self, family_id: str) -> None:
        """No more forks of this family; release its trunk (live branches keep what they share)."""
        for trunk_id in self.families.close(family_id):
            self._end(trunk_id)

    def release(self, state_id: str) -> None:
        """Release a retained state that no family holds."""
        self._states.get(state_id)
        self._end(state_id)

    def retained(self, state_id: str) -> Sequence:
        """A retained state (read-only use: its tokens, block table, held logits)."""
        return self._states.get(state_id)

    def add_request(self, request: Request) -> None:
        """Queue a request after checking it can be served; raises a KMeshError if not."""
        self._check(request)
        self._live_ids.add(request.request_id)
        if request.retain:
            self._states.expect(request)
        if request.parent_id is None:
            if request.retain:
                self.families.add_state(request.request_id)
            seq = Sequence.from_request(request, lora=self.adapters.use(request))
            if request.recovery is not None:
                spec, seq.stats.quality = resolve_quality(request.recovery.spec, self.fingerprint)
                refusal = None
                if spec is not None:
                    refusal = recovery_refusal(spec, request.tenant_salt, request.adapter)
                if spec is not None and refusal is None:
                    seq.recovery = replace(request.recovery, spec=spec)
                elif refusal is not None:
                    seq.stats.recovery = {"refused": refusal}
            self.scheduler.add(seq)
            return
        self.families.add_branch(request.parent_id, request.request_id)
        if request.parent_id in self._states:
            self._start_fork(request)
        else:
            self._states.queue_fork(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is: waiting, running, a fork waiting for its trunk, or a
        retained state. Its blocks go back to the pool, its store claims are abandoned and its
        family membership ends (a trunk whose branches have all ended is released); forks still
        waiting for it are aborted too. step() returns nothing of it. False when no such request
        is live (it ended already, or never came)."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.scheduler.abort(seq)
            if self._link is not None:
                self._link.end_member(seq.request)
        elif self._states.is_queued(request_id):
            self._states.unqueue(request_id)
        elif request_id not in self._states:
            return False
        for fork in self._states.take_forks(request_id):
            self.abort(fork.request_id)
        self._end(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended)

    def output_ids(self, request_id: str) -> tuple[int, ...]:
        """Tokens a running or waiting request has generated so far (for streaming; none for a
        fork still waiting for its trunk); step() returns the whole output when it ends."""
        seq = self._unfinished(request_id)
        return () if seq is None else tuple(seq.output_ids)

    def output_logprobs(
        self, request_id: str, start: int = 0
    ) -> tuple[tuple[float, ...], tuple[TopLogprobs, ...]]:
        """The log-probabilities of those tokens from output position `start` on, and their top
        ones (as RequestOutput's)."""
        seq = self._unfinished(request_id)
        if seq is None:
            return (), ()
        return tuple(seq.output_logprobs[start:]), tuple(seq.output_top_logprobs[start:])

    def _unfinished(self, request_id: str) -> Sequence | None:
        """The request's sequence; None for a fork whose trunk has not been retained yet."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            return seq
        if self._states.is_queued(request_id):
            return None
        raise ContractError(f"request {request_id!r} is not running or waiting")

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that ended since the last step (finished, or
        retained for forks)."""
        batch = self.scheduler.schedule()
        if batch.seqs:
            self._run(batch)
        elif self.scheduler.num_store_waits and not self._ended:
            time.sleep(STORE_POLL_S)  # only requests waiting for another engine's blocks
        elif not self._ended:
            raise OutOfBlocksError(
                "no waiting request fits in the KV cache even with nothing running (retained "
                "trunks may pin it): raise kv_cache_tokens or close families sooner"
            )
        ended, self._ended = self._ended, []
        return ended

    def _run(self, batch: ScheduledBatch) -> None:
        self.counters.computed_tokens += sum(len(s.token_ids) - s.num_computed for s in batch.seqs)
        self.counters.peak_blocks_in_use = max(
            self.counters.peak_blocks_in_use, self.kv.num_blocks_in_use
        )
        if self.store is None:
            logits = self.runner.step(batch)
        else:
            with self.store.leases_renewed():  # a long prefill keeps its store claims
                logits = self.runner.step(batch)
        for seq, row in zip(batch.seqs, logits, strict=True):
            self.kv.register_full_blocks(seq)
            if seq.transcript and self._link is not None:
                self._link.pin_transcript(seq.request, seq.transcript)
            seq.transcript = ()
            if seq.request.params is None or seq.finish_reason is not None:
                self._retain(seq, row)  # a retained request's last token is now computed
                continue
            sample_into(seq, row)
            seq.finish_reason = finish_reason(seq, self.config, self.context.tokens, self.decode)
            if seq.finish_reason is not None and not seq.request.retain:
                self._finish(seq)

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Run the requests to completion together; outputs in the order given."""
        order = []
        for request in requests:
            self.add_request(request)
            order.append(request.request_id)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for output in self.step():
                done[output.request_id] = output
        waiting = [request_id for request_id in order if request_id not in done]
        if waiting:
            raise ContractError(
                f"requests {waiting} fork trunks that were never sent "
                f"({self._states.waited_trunks()}): send each trunk (retain=True) too"
            )
        return [done[request_id] for request_id in order]

    def _check(self, request: Request) -> None:
        self.adapters.check(request)
        if request.request_id in self._live_ids or request.request_id in self._states:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if self.families.trunk_family(request.request_id) is not None and not request.retain:
            raise ContractError(
                f"request {request.request_id!r} is a declared family trunk: send it with "
                "retain=True so its branches can fork it"
            )
        self._states.check_trunk(request)
        check_request(request, self.config, self.context.tokens, self.decode)
        if request.parent_id is not None:
            self.families.check_fork(request.parent_id, 1)
            self._states.check_fork(request)

    def _start_fork(self, request: Request) -> None:
        parent = self._states.get(request.parent_id or "")
        seq = Sequence.from_request(
            request, parent.token_ids, self.adapters.fork_use(request, parent)
        )
        take_held(seq, parent)
        if len(seq.token_ids) >= self.context.tokens:
            # The parent's tokens and the fork's own fill the context: nothing to generate.
            seq.finish_reason = "length"
            self._finish(seq)
            return
        self.kv.fork(parent, seq)
        if not request.prompt_ids and request.params is not None:
            assert parent.held_logits is not None
            sample_into(seq, parent.held_logits)
            seq.finish_reason = finish_reason(seq, self.config, self.context.tokens, self.decode)
            if seq.finish_reason is not None and not request.retain:
                seq.stats.reused_tokens = seq.num_computed
                self._finish(seq)  # NOTE: a one-token branch never computes anything
                return
        self.scheduler.add(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.request.keep_output and seq.request.adapter is None:
            seq.stats.kept_output_tokens = self.runner.keep_output(seq)
        self._ended.append(request_output(seq))
        if seq in self.scheduler.running:
            self.scheduler.finish(seq)
        else:
            self.kv.free(seq)
        if self._link is not None:
            self._link.end_member(seq.request)
        self._end(seq.request.request_id)

    def _retain(self, seq: Sequence, logits: torch.Tensor) -> None:
        seq.held_logits = logits
        seq.finish_reason = seq.finish_reason or "retained"
        self.scheduler.retain(seq)
        state_id = seq.request.request_id
        forks = self._states.add(seq)
        self._live_ids.discard(state_id)
        self._ended.append(request_output(seq))
        release_now = self.families.mark_ready(state_id)
        for request in forks:
            self._start_fork(request)
        for trunk_id in release_now:
            self._end(trunk_id)

    def _end(self, state_id: str) -> None:
        """A state is done: release it, and every trunk whose family it completes."""
        self._live_ids.discard(state_id)
        for trunk_id in [state_id, *self.families.end(state_id)]:
            trunk = self._states.drop(trunk_id)
            if trunk is not None:
                self.kv.free(trunk)
