"""The reference engine: requests in, completions out, over one executor and a paged KV cache."""

import time
from collections.abc import Iterable
from dataclasses import replace

from kmesh.compute.executor import Executor
from kmesh.engine.kv_manager import KVCacheManager, blocks_for
from kmesh.engine.request import Request, RequestOutput
from kmesh.engine.runner import ModelRunner
from kmesh.engine.scheduler import Scheduler
from kmesh.engine.sequence import Sequence
from kmesh.errors import InvalidRequestError, OutOfBlocksError
from kmesh.kv.kv_cache import PagedKVCache


class Engine:
    """Batches requests step by step; shares exact prefixes through the block index.

    Args:
        executor: the model.
        model_fingerprint: the `model` part of every state key (see compute.loader).
        block_size: tokens per KV block; prefix sharing works in whole blocks.
        kv_cache_tokens: capacity of the KV pool in tokens (rounded up to whole blocks).
        max_batch_tokens: tokens computed per step at most (a longer prompt runs alone).
        max_seqs: sequences running at once at most.
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
    ) -> None:
        if block_size < 1 or kv_cache_tokens < block_size:
            raise InvalidRequestError(
                f"block_size ({block_size}) must be >= 1 and kv_cache_tokens "
                f"({kv_cache_tokens}) at least one block"
            )
        self.executor = executor
        self.config = executor.config
        num_blocks = blocks_for(kv_cache_tokens, block_size)
        self.kv = KVCacheManager(num_blocks, block_size, model_fingerprint)
        self.cache = PagedKVCache(self.config, num_blocks, block_size, executor.dtype)
        self.scheduler = Scheduler(self.kv, max_batch_tokens, max_seqs)
        self.runner = ModelRunner(executor, self.cache)
        self._live_ids: set[str] = set()

    def add_request(self, request: Request) -> None:
        """Queue a request after checking it can be served; raises InvalidRequestError if not."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if n > self.config.max_position:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the model's context is "
                f"{self.config.max_position} tokens: shorten the prompt"
            )
        bad = [t for t in request.prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the model's vocabulary [0, {self.config.vocab_size})"
            )
        if request.request_id in self._live_ids:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        longest = min(n + request.params.max_tokens, self.config.max_position)
        if blocks_for(longest, self.kv.block_size) > self.kv.pool.num_blocks:
            raise OutOfBlocksError(
                f"request {request.request_id!r} needs up to {longest} tokens of KV but the "
                f"cache holds {self.kv.pool.num_blocks * self.kv.block_size}: raise "
                "kv_cache_tokens or lower max_tokens"
            )
        stop_ids = request.params.stop_token_ids or self.config.eos_token_ids
        request = replace(request, params=replace(request.params, stop_token_ids=stop_ids))
        self._live_ids.add(request.request_id)
        self.scheduler.add(Sequence.from_request(request))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch:
            raise OutOfBlocksError(
                "no waiting request fits in the KV cache even with nothing running: "
                "raise kv_cache_tokens"
            )
        sampled = self.runner.step(batch)
        now = time.perf_counter()
        finished = []
        for seq, (token, logprob) in zip(batch, sampled, strict=True):
            self.kv.register_full_blocks(seq)
            seq.token_ids.append(token)
            seq.output_logprobs.append(logprob)
            if len(seq.output_ids) == 1:
                seq.stats.first_token_seconds = now - seq.submitted_at
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                seq.stats.output_tokens = len(seq.output_ids)
                seq.stats.seconds = now - seq.submitted_at
                self.scheduler.finish(seq)
                self._live_ids.discard(seq.request.request_id)
                finished.append(self._output(seq))
        return finished

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
        return [done[request_id] for request_id in order]

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.request.params
        if token in params.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= params.max_tokens:
            return "length"
        if len(seq.token_ids) >= self.config.max_position:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        assert seq.finish_reason is not None
        return RequestOutput(
            request_id=seq.request.request_id,
            prompt_ids=seq.request.prompt_ids,
            output_ids=tuple(seq.output_ids),
            logprobs=tuple(seq.output_logprobs),
            finish_reason=seq.finish_reason,
            stats=seq.stats,
        )
