"""`kmesh serve --engine vllm`: vLLM's AsyncLLM with KMeshConnector behind the HTTP server.

vLLM is imported only when the engine starts (the import alone takes ~20 s on 2 cores). The
caller's `kmesh` object reaches the connector as the request's `kv_transfer_params["kmesh"]`,
and the connector's per-request stats come back the same way on the final output. A job whose
caller stops listening closes vLLM's generator, which aborts the request in vLLM (its pages
freed, no more steps). The engine's load comes from a stat logger vLLM calls after each step
(kmesh/vllm/load_logger.py).
"""

import os
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.loader import load_tokenizer
from kmesh.serve.backend import Delta, EngineStoppedError, GenerationJob, TokenLogprob
from kmesh.serve.branches import prefix_shared_branches
from kmesh.state.request_meta import KMESH_PARAMS_KEY
from kmesh.stats import EngineLoad
from kmesh.vllm.config import (
    ALLOCATOR_ENV,
    DEFAULT_DTYPE,
    DEFAULT_KV_CACHE_BYTES,
    cpu_thread_binding,
    vllm_context,
    vllm_engine_kwargs,
)


class VLLMBackend:
    """vLLM (CPU settings of kmesh.vllm.config) on a model folder, or the embedded model (None).

    Args:
        model: what to serve.
        store: socket of a `kmesh store serve` process, handed to KMeshConnector.
        recovery_bytes: what the connector's worker keeps for recovery at most (None: 1 GiB).
        heap_reserve_bytes: the worker's heap reserve (None: half the KV cache; 0: none).
        kv_cache_bytes: vLLM's KV cache (None: kmesh.vllm.config's default, 1 GiB).
        dtype: the model's and the KV cache's, "float32" or "bfloat16".
        tensor_parallel_size: vLLM's workers, each with a shard of the heads (on the CPU, each
            bound to its share of this process's cores unless VLLM_CPU_OMP_THREADS_BIND says).
        max_model_len: the context (None: the model's, bounded by the KV cache: vllm_context).
    """

    engine = "vllm"

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        store: str | None = None,
        recovery_bytes: int | None = None,
        heap_reserve_bytes: int | None = None,
        kv_cache_bytes: int | None = None,
        dtype: str = DEFAULT_DTYPE,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
    ) -> None:
        self._engine_kwargs = vllm_engine_kwargs(
            model,
            store=store,
            recovery_bytes=recovery_bytes,
            heap_reserve_bytes=heap_reserve_bytes,
            kv_cache_bytes=kv_cache_bytes or DEFAULT_KV_CACHE_BYTES,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
        )
        config = ModelConfig.from_folder(Path(self._engine_kwargs["model"]))
        self.vocab_size = config.vocab_size
        self.context = vllm_context(
            config,
            max_model_len=max_model_len,
            kv_cache_bytes=self._engine_kwargs["kv_cache_memory_bytes"],
            dtype=dtype,
            block_size=self._engine_kwargs["block_size"],
            tensor_parallel_size=tensor_parallel_size,
        )
        self._binding = None
        if tensor_parallel_size > 1 and not torch.cuda.is_available():  # vLLM's CPU platform
            self._binding = cpu_thread_binding(tensor_parallel_size)
        path = Path(self._engine_kwargs["model"])
        self.model_id = path.name
        self.tokenizer = load_tokenizer(path)
        self.max_model_len: int = self._engine_kwargs["max_model_len"]
        self._llm: Any = None
        self._load = EngineLoad(running=0, waiting=0, kv_usage=0.0, computed_tokens=0)

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from kmesh.vllm.load_logger import load_logger

        for name, value in ALLOCATOR_ENV.items():  # the engine's processes inherit it
            os.environ.setdefault(name, value)
        if self._binding is not None:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", self._binding)
        # Its worker (kmesh/vllm/worker.py) attaches recovery to vLLM's own loaded model.
        self._llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**self._engine_kwargs), stat_loggers=[load_logger(self._set_load)]
        )

    def _set_load(self, load: EngineLoad) -> None:
        self._load = load

    def failure(self) -> str | None:
        if self._llm is None or not self._llm.errored:
            return None
        return f"vLLM's engine failed ({type(self._llm.dead_error).__name__})"

    def load(self) -> EngineLoad:
        return self._load

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def branches(self, job: GenerationJob, n: int) -> AsyncGenerator[tuple[int, Delta], None]:
        return prefix_shared_branches(self, job, n)

    async def generate(self, job: GenerationJob) -> AsyncGenerator[Delta, None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra_args = None
        if job.kmesh is not None:
            kmesh = job.kmesh.model_dump(exclude_none=True)
            extra_args = {"kv_transfer_params": {KMESH_PARAMS_KEY: kmesh}}
        params = SamplingParams(
            **job.sampling(),
            stop=list(job.stop),
            logprobs=job.logprobs,
            ignore_eos=job.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": list(job.prompt_ids)}
        if job.cache_salt is not None:
            prompt["cache_salt"] = job.cache_salt
        from vllm.v1.engine.exceptions import EngineDeadError

        outputs = self._llm.generate(prompt, params, f"serve-{uuid.uuid4().hex}")
        try:
            async with aclosing(outputs):  # closing it early aborts the request in vLLM
                async for output in outputs:
                    completion = output.outputs[0]
                    token_ids = tuple(completion.token_ids)
                    logprobs = _logprobs(token_ids, completion.logprobs, job.logprobs)
                    if not output.finished:
                        yield Delta(token_ids, logprobs=logprobs)
                        continue
                    stats = _stats(output, len(job.prompt_ids))
                    yield Delta(token_ids, completion.finish_reason, stats, logprobs)
        except EngineDeadError as error:
            raise EngineStoppedError(
                f"vLLM's engine failed ({type(error).__name__}); the server log has the "
                "details: restart kmesh serve"
            ) from error


def _logprobs(token_ids: tuple[int, ...], given: Any, k: int | None) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token {token id: Logprob} (the sampled token and the k most likely, ranked
    from 1) as TokenLogprobs."""
    if k is None or given is None:
        return ()
    result = []
    for token, entries in zip(token_ids, given, strict=True):
        ranked = sorted(
            (entry.rank, t, entry.logprob) for t, entry in entries.items() if entry.rank <= k
        )
        top = tuple((t, logprob) for _, t, logprob in ranked)
        result.append(TokenLogprob(entries[token].logprob, top))
    return tuple(result)


def _stats(output: Any, num_prompt: int) -> dict[str, Any]:
    """The connector's stats for a finished request, or what vLLM itself reports without them."""
    reported = (output.kv_transfer_params or {}).get(KMESH_PARAMS_KEY)
    if reported is not None:
        return dict(reported)
    reused = output.num_cached_tokens or 0
    return {
        "prompt_tokens": num_prompt,
        "computed_tokens": num_prompt - reused,
        "reused_tokens": reused,
        "restored_tokens": 0,
        "recovered_tokens": 0,
    }
