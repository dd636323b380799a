"""The reference engine: requests in, completions out, over one executor and a paged KV cache.

Exact sharing happens two ways, both by reference to the same physical blocks: the prefix index
(full blocks a request happens to share with earlier ones) and forks (a branch declared to start
from a retained state, which shares every block, copies the partly filled last one on its first
write, and samples its first token from the parent's held logits).

Requests may run under LoRA adapters loaded into the engine, several in one batch; what state
they may share is engine/adapters.py's rule.
"""

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kmesh.compute.executor import Executor
from kmesh.compute.lora import LoraAdapter
from kmesh.coord.families import FamilyRegistry
from kmesh.engine.adapters import Adapters
from kmesh.engine.block_store import BlockStore
from kmesh.engine.checks import check_request
from kmesh.engine.kv_manager import KVCacheManager
from kmesh.engine.request import Request, RequestOutput, TopLogprobs
from kmesh.engine.runner import ModelRunner
from kmesh.engine.sampler import sample
from kmesh.engine.scheduler import ScheduledBatch, Scheduler
from kmesh.engine.sequence import Sequence
from kmesh.engine.stop_strings import first_stop
from kmesh.errors import ContractError, InvalidRequestError, OutOfBlocksError
from kmesh.kv.block_pool import blocks_for
from kmesh.kv.kv_cache import PagedKVCache
from kmesh.recovery.requests import DEFAULT_RECOVERY_BYTES
from kmesh.state.request_meta import recovery_refusal
from kmesh.store import TenantClients
from kmesh.store.shared_state import shared_through

# How long a step waits when every waiting request waits for another engine's blocks.
STORE_POLL_S = 0.02


@dataclass(slots=True)
class EngineCounters:
    # Token positions run through the model, every kind (prefill, decode, recomputation).
    computed_tokens: int = 0
    # Most blocks held by live or retained sequences at once (cached free blocks not counted).
    peak_blocks_in_use: int = 0


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
    """

    def __init__(
        self,
        executor: Executor,
        model_fingerprint: str,
        *,
        block_size: int = 16,
        kv_cache_tokens: int = 16384,
        max_batch_tokens: int = 4096,
        max_seqs: int = 32,
        prefix_caching: bool = True,
        store: str | None = None,
        adapters: Iterable[LoraAdapter] = (),
        decode: Callable[[list[int]], str] | None = None,
        recovery_bytes: int = DEFAULT_RECOVERY_BYTES,
    ) -> None:
        """`decode`: token ids to text (the tokenizer's), for requests with stop strings."""
        if block_size < 1 or kv_cache_tokens < block_size:
            raise InvalidRequestError(
                f"block_size ({block_size}) must be >= 1 and kv_cache_tokens "
                f"({kv_cache_tokens}) at least one block"
            )
        self.executor = executor
        self.config = executor.config
        self.decode = decode
        self.adapters = Adapters(adapters)
        num_blocks = blocks_for(kv_cache_tokens, block_size)
        self.cache = PagedKVCache(self.config, num_blocks, block_size, executor.dtype)
        if store is not None and not prefix_caching:
            raise InvalidRequestError("a store needs prefix caching (it shares blocks by key)")
        self.store = None if store is None else BlockStore(store, self.cache)
        self.kv = KVCacheManager(
            num_blocks, block_size, model_fingerprint, prefix_caching, self.store
        )
        self.scheduler = Scheduler(self.kv, max_batch_tokens, max_seqs)
        # What recovery shares with the other engines on the store.
        self._store_clients = None if store is None else TenantClients(store)
        shared = None
        if self._store_clients is not None:
            shared = shared_through(self._store_clients, model_fingerprint, self.config)
        self.runner = ModelRunner(executor, self.cache, model_fingerprint, recovery_bytes, shared)
        self.families = FamilyRegistry()
        self.counters = EngineCounters()
        # Outputs of requests that ended since the last step() returned.
        self._ended: list[RequestOutput] = []
        self._live_ids: set[str] = set()
        self._retained: dict[str, Sequence] = {}
        # Forks of declared trunks that are not computed yet, started when the trunk is retained.
        self._queued_forks: defaultdict[str, list[Request]] = defaultdict(list)
        # Tenant salt of every retained (forkable) state: forks must carry the same.
        self._state_salts: dict[str, str | None] = {}
        # Adapter of every retained state (None: the base model).
        self._state_adapters: dict[str, str | None] = {}

    def close(self) -> None:
        """Close the store connections, if any (they reopen on the next use)."""
        if self.store is not None:
            self.store.close()
        if self._store_clients is not None:
            self._store_clients.close()

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
        self.retained(state_id)
        self._end(state_id)

    def retained(self, state_id: str) -> Sequence:
        """A retained state (read-only use: its tokens, block table, held logits)."""
        if state_id not in self._retained:
            raise ContractError(f"state {state_id!r} is not retained")
        return self._retained[state_id]

    def add_request(self, request: Request) -> None:
        """Queue a request after checking it can be served; raises a KMeshError if not."""
        self._check(request)
        self._live_ids.add(request.request_id)
        if request.retain:
            self._state_salts[request.request_id] = request.tenant_salt
            self._state_adapters[request.request_id] = request.adapter
        if request.parent_id is None:
            if request.retain:
                self.families.add_state(request.request_id)
            seq = Sequence.from_request(request, lora=self.adapters.use(request))
            if request.recovery is not None:
                refusal = recovery_refusal(
                    request.recovery.spec, request.tenant_salt, request.adapter
                )
                if refusal is None:
                    seq.recovery = request.recovery
                else:
                    seq.stats.recovery = {"refused": refusal}
            self.scheduler.add(seq)
            return
        self.families.add_branch(request.parent_id, request.request_id)
        if request.parent_id in self._retained:
            self._start_fork(request)
        else:
            self._queued_forks[request.parent_id].append(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is: waiting, running, a fork waiting for its trunk, or a
        retained state. Its blocks go back to the pool, its store claims are abandoned and its
        family membership ends (a trunk whose branches have all ended is released); forks still
        waiting for it are aborted too. step() returns nothing of it. False when no such request
        is live (it ended already, or never came)."""
        seq = next(
            (
                s
                for s in (*self.scheduler.running, *self.scheduler.waiting)
                if s.request.request_id == request_id
            ),
            None,
        )
        if seq is not None:
            self.scheduler.abort(seq)
        elif any(r.request_id == request_id for q in self._queued_forks.values() for r in q):
            for queued in self._queued_forks.values():
                queued[:] = [r for r in queued if r.request_id != request_id]
        elif request_id not in self._retained:
            return False
        for fork in self._queued_forks.pop(request_id, []):
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
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            if seq.request.request_id == request_id:
                return seq
        if any(r.request_id == request_id for q in self._queued_forks.values() for r in q):
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
            if seq.request.params is None or seq.finish_reason is not None:
                self._retain(seq, row)  # a retained request's last token is now computed
                continue
            self._sample_into(seq, row)
            seq.finish_reason = self._finish_reason(seq)
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
                f"({sorted(self._queued_forks)}): send each trunk (retain=True) too"
            )
        return [done[request_id] for request_id in order]

    def _check(self, request: Request) -> None:
        self.adapters.check(request)
        if request.request_id in self._live_ids or request.request_id in self._retained:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if self.families.trunk_family(request.request_id) is not None and not request.retain:
            raise ContractError(
                f"request {request.request_id!r} is a declared family trunk: send it with "
                "retain=True so its branches can fork it"
            )
        early_forks = self._queued_forks.get(request.request_id, [])
        if any(not self.adapters.may_fork(fork, request.adapter) for fork in early_forks):
            raise ContractError(
                f"trunk {request.request_id!r} runs under adapter {request.adapter!r}, which "
                "branches already sent for it may not fork: state never crosses adapters"
            )
        if any(fork.tenant_salt != request.tenant_salt for fork in early_forks):
            raise ContractError(
                f"trunk {request.request_id!r} has another tenant salt than branches already "
                "sent for it: state never crosses tenants"
            )
        check_request(
            request, self.config, self.kv.block_size, self.kv.pool.num_blocks, self.decode
        )
        if request.parent_id is not None:
            self.families.check_fork(request.parent_id, 1)
            parent_salt = self._state_salts.get(request.parent_id, request.tenant_salt)
            if parent_salt != request.tenant_salt:
                raise ContractError(
                    f"request {request.request_id!r} forks {request.parent_id!r} of another "
                    "tenant salt: state never crosses tenants"
                )
            parent_adapter = self._state_adapters.get(request.parent_id, request.adapter)
            if not self.adapters.may_fork(request, parent_adapter):
                raise ContractError(
                    f"request {request.request_id!r} (adapter {request.adapter!r}) forks "
                    f"{request.parent_id!r} (adapter {parent_adapter!r}): state never crosses "
                    "adapters (only an activated adapter whose invocation follows a base "
                    "trunk may fork it)"
                )

    def _start_fork(self, request: Request) -> None:
        parent = self._retained[request.parent_id or ""]
        seq = Sequence.from_request(
            request, parent.token_ids, self.adapters.fork_use(request, parent)
        )
        if len(seq.token_ids) >= self.config.max_position:
            # The parent's tokens and the fork's own fill the context: nothing to generate.
            seq.finish_reason = "length"
            self._finish(seq)
            return
        self.kv.fork(parent, seq)
        if not request.prompt_ids and request.params is not None:
            assert parent.held_logits is not None
            self._sample_into(seq, parent.held_logits)
            seq.finish_reason = self._finish_reason(seq)
            if seq.finish_reason is not None and not request.retain:
                seq.stats.reused_tokens = seq.num_computed
                self._finish(seq)  # NOTE: a one-token branch never computes anything
                return
        self.scheduler.add(seq)

    def _sample_into(self, seq: Sequence, logits: torch.Tensor) -> None:
        params = seq.request.params
        assert params is not None
        prompt = seq.token_ids[: seq.num_prompt]
        token, logprob, top = sample(logits, params, seq.generator, prompt, seq.output_ids)
        seq.append(token, logprob, logits, top)
        if len(seq.output_ids) == 1:
            seq.stats.first_token_seconds = time.perf_counter() - seq.submitted_at

    def _finish_reason(self, seq: Sequence) -> str | None:
        params = seq.request.params
        assert params is not None
        stop_ids = (
            self.config.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        )
        if seq.token_ids[-1] in stop_ids:
            return "stop"
        decode = self.decode
        if params.stop and decode and first_stop(decode(seq.output_ids), params.stop) is not None:
            return "stop"
        if len(seq.output_ids) >= params.max_tokens:
            return "length"
        if len(seq.token_ids) >= self.config.max_position:
            return "length"
        return None

    def _finish(self, seq: Sequence) -> None:
        if seq.request.keep_output and seq.request.adapter is None:
            seq.stats.kept_output_tokens = self.runner.keep_output(seq)
        self._ended.append(self._output(seq))
        if seq in self.scheduler.running:
            self.scheduler.finish(seq)
        else:
            self.kv.free(seq)
        self._end(seq.request.request_id)

    def _retain(self, seq: Sequence, logits: torch.Tensor) -> None:
        seq.held_logits = logits
        seq.finish_reason = seq.finish_reason or "retained"
        self.scheduler.retain(seq)
        state_id = seq.request.request_id
        self._retained[state_id] = seq
        self._live_ids.discard(state_id)
        self._ended.append(self._output(seq))
        release_now = self.families.mark_ready(state_id)
        for request in self._queued_forks.pop(state_id, []):
            self._start_fork(request)
        for trunk_id in release_now:
            self._end(trunk_id)

    def _end(self, state_id: str) -> None:
        """A state is done: release it, and every trunk whose family it completes."""
        self._live_ids.discard(state_id)
        for trunk_id in [state_id, *self.families.end(state_id)]:
            trunk = self._retained.pop(trunk_id, None)
            if trunk is not None:
                self.kv.free(trunk)
            self._state_salts.pop(trunk_id, None)
            self._state_adapters.pop(trunk_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        assert seq.finish_reason is not None
        seq.stats.output_tokens = len(seq.output_ids)
        seq.stats.seconds = time.perf_counter() - seq.submitted_at
        return RequestOutput(
            request_id=seq.request.request_id,
            prompt_ids=tuple(seq.token_ids[: seq.num_prompt]),
            output_ids=tuple(seq.output_ids),
            logprobs=tuple(seq.output_logprobs),
            top_logprobs=tuple(seq.output_top_logprobs),
            finish_reason=seq.finish_reason,
            stats=seq.stats,
            logits=tuple(seq.output_logits) if seq.request.keep_logits else None,
        )
