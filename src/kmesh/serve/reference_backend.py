"""`kmesh serve --engine reference`: the reference engine behind the HTTP server.

The engine is synchronous and single-threaded, so one background thread owns it: it takes new
requests (and aborts) from a thread-safe queue, steps the engine while any request is live, and
hands each request's new tokens to the asyncio task waiting for them (one asyncio queue per
request). A request whose caller stops listening (a closed stream) is aborted before the next
step: its blocks go back to the pool and no more of it is computed.

A request's `kmesh.family` is accepted and echoed; on this engine the family's trunk is shared
through the local prefix cache (and the store, with `--store`) like any common prefix. With a
store, a request that declares `next_use` has its transcript pinned for its family
(engine/store_link.py), until `branches` members of the family ended here or one carrying
`close` did; a request with `n` > 1 does not (its trunk is an engine family of its own).
`kmesh.recovery` with `kmesh.segments` (a round, a policy) is served as vLLM's connector serves
it (kmesh/recovery/requests.py), with the same stats under `recovery`. A request's `n` > 1
choices are an engine family of their own: one retained trunk, n copy-on-write forks
(`branches`).
"""

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kmesh.compute.config import ModelConfig
from kmesh.compute.loader import LoadedModel, load_model, resolve_model_dir
from kmesh.engine.engine import Engine, reference_context
from kmesh.engine.request import Request, RequestOutput, SamplingParams
from kmesh.errors import ContractError, KMeshError
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.serve.backend import Delta, EngineStoppedError, GenerationJob, TokenLogprob
from kmesh.state.request_meta import segment_spans
from kmesh.stats import EngineLoad

logger = logging.getLogger(__name__)

STAT_NAMES = (
    "prompt_tokens",
    "computed_tokens",
    "reused_tokens",
    "restored_tokens",
    "recovered_tokens",
)

# What the engine thread hands a request's task: a delta, or the error that ended it.
Post = Callable[[Delta | BaseException], None]


# The index a family trunk's deltas are posted under (`branches`).
_TRUNK = -1


@dataclass(slots=True)
class _Live:
    post: Post
    # The job asked for log-probabilities.
    logprobs: bool = False
    # Output tokens already posted.
    num_sent: int = 0


@dataclass(frozen=True, slots=True)
class _Submission:
    """Requests the engine thread adds together; `family`: (family id, trunk id, branches) to
    declare first."""

    requests: list[tuple[Request, _Live]]
    family: tuple[str, str, int] | None = None


@dataclass(frozen=True, slots=True)
class _Abort:
    """A submission whose caller went away: its requests to stop, its family to close first."""

    request_ids: tuple[str, ...]
    family: str | None = None


class ReferenceBackend:
    """The reference engine over a model folder, a loaded model, or the embedded model (None).

    Args:
        model: what to serve.
        store: socket of a `kmesh store serve` process (restore from it, publish to it).
        max_model_len: the context, prompt and output together (None: the model's, bounded by
            the KV pool: reference_context).
        kv_cache_bytes: the KV pool in bytes of float32 rows (None: `kv_cache_tokens` of
            `engine_options`, or the engine's default).
        engine_options: passed on to `Engine` (block_size, kv_cache_tokens, ...).
    """

    engine = "reference"

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        store: str | None = None,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        **engine_options: Any,
    ) -> None:
        config = (
            model.config
            if isinstance(model, LoadedModel)
            else ModelConfig.from_folder(resolve_model_dir(model))
        )
        if kv_cache_bytes is not None:
            engine_options["kv_cache_tokens"] = kv_cache_bytes // config.kv_bytes_per_token(
                "float32"
            )
        # Refused before the weights load, in one line (the engine resolves it the same way).
        pool = {k: v for k, v in engine_options.items() if k in ("block_size", "kv_cache_tokens")}
        reference_context(config, max_model_len, **pool)
        loaded = model if isinstance(model, LoadedModel) else load_model(model)
        self.model_id = loaded.path.name
        self.tokenizer = loaded.tokenizer
        self._engine = Engine(
            loaded.executor,
            loaded.fingerprint,
            store=store,
            decode=loaded.tokenizer.decode,
            max_model_len=max_model_len,
            **engine_options,
        )
        self.context = self._engine.context
        self.max_model_len = self.context.tokens
        self.vocab_size = loaded.config.vocab_size
        # Requests to add or abort, or None to stop the thread.
        self._inbox: queue.SimpleQueue[_Submission | _Abort | None] = queue.SimpleQueue()
        self._request_ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kmesh-engine", daemon=True)
        # Set (under the lock) when the thread died; later requests fail at once.
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        # Replaced by the engine thread after each step.
        self._load = EngineLoad(running=0, waiting=0, kv_usage=0.0, computed_tokens=0)

    async def start(self) -> None:
        self._thread.start()

    async def close(self) -> None:
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._engine.close()

    def failure(self) -> str | None:
        with self._lock:
            return None if self._failure is None else _described(self._failure)

    def load(self) -> EngineLoad:
        return self._load

    async def generate(self, job: GenerationJob) -> AsyncGenerator[Delta, None]:
        async with aclosing(self.branches(job, 1)) as deltas:
            async for _, delta in deltas:
                yield delta

    async def branches(self, job: GenerationJob, n: int) -> AsyncGenerator[tuple[int, Delta], None]:
        """The job's `n` choices. n > 1 is a family: the prompt computed once, as a retained
        trunk, and each branch forked from it copy-on-write, its first token sampled from the
        trunk's held logits (seed job.seed + i). Branch 0's last delta carries the trunk's
        prompt split (computed, reused, restored, recovered, recovery); the others report
        their prompt reused."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()

        def live(index: int, logprobs: bool) -> _Live:
            def post(item: Delta | BaseException) -> None:  # on the engine thread
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                    loop.call_soon_threadsafe(deltas.put_nowait, (index, item))

            return _Live(post, logprobs)

        submission = self._submission(job, n, live)
        with self._lock:
            if self._failure is not None:
                raise _failed(self._failure) from self._failure
            self._inbox.put(submission)
        trunk: dict[str, Any] = {}
        finished = 0
        try:
            while finished < n:
                index, item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                if index == _TRUNK:
                    trunk = {k: v for k, v in (item.stats or {}).items() if k != "prompt_tokens"}
                    continue
                if item.finish_reason is not None:
                    finished += 1
                    if index == 0 and trunk:
                        item = replace(item, stats={**(item.stats or {}), **trunk})
                yield index, item
        finally:
            if finished < n:  # the caller went away (or the engine refused or failed)
                ids = tuple(request.request_id for request, _ in submission.requests)
                family = None if submission.family is None else submission.family[0]
                self._inbox.put(_Abort(ids, family))

    def _submission(
        self, job: GenerationJob, n: int, live: Callable[[int, bool], "_Live"]
    ) -> "_Submission":
        """The engine requests of a job's n choices (`branches`), each with where its deltas go."""
        base = f"serve-{next(self._request_ids)}"
        logprobs = job.logprobs is not None

        def params(index: int) -> SamplingParams:
            seed = None if job.seed is None else job.seed + index
            sampling = {**job.sampling(), "seed": seed}
            stop_ids = () if job.ignore_eos else None
            return SamplingParams(
                **sampling, stop=job.stop, stop_token_ids=stop_ids, top_logprobs=job.logprobs or 0
            )

        recovery = self._recovery(job)
        if n == 1:
            keep = job.kmesh is not None and job.kmesh.keep_output
            request = Request(
                base,
                job.prompt_ids,
                params(0),
                job.cache_salt,
                recovery=recovery,
                keep_output=keep,
                kmesh=job.kmesh,
            )
            return _Submission([(request, live(0, logprobs))])
        trunk_id = f"{base}/trunk"
        trunk = Request(
            trunk_id, job.prompt_ids, None, job.cache_salt, retain=True, recovery=recovery
        )
        forks = [
            (
                Request(f"{base}/{i}", (), params(i), job.cache_salt, parent_id=trunk_id),
                live(i, logprobs),
            )
            for i in range(n)
        ]
        return _Submission([(trunk, live(_TRUNK, False)), *forks], (f"{base}/family", trunk_id, n))

    def _recovery(self, job: GenerationJob) -> RecoveryRequest | None:
        """The job's recovery over its segments (serve/jobs.py made its prompt from them)."""
        kmesh = job.kmesh
        if kmesh is None or kmesh.recovery is None or kmesh.segments is None:
            return None
        _, spans = segment_spans(self.tokenizer, kmesh)
        return RecoveryRequest(tuple(spans), kmesh.recovery, kmesh.family)

    def _run(self) -> None:
        live: dict[str, _Live] = {}
        try:
            while self._admit(live, wait=not live):
                if live:
                    self._step(live)
        except Exception as error:
            logger.exception("the reference engine failed; failing every live request")
            with self._lock:
                self._failure = error
            stopped = _failed(error)
        else:
            stopped = EngineStoppedError("the server is shutting down")
        for request in live.values():
            request.post(stopped)
        while not self._inbox.empty():
            item = self._inbox.get()
            if isinstance(item, _Submission):
                for _, waiting in item.requests:
                    waiting.post(stopped)

    def _admit(self, live: dict[str, _Live], *, wait: bool) -> bool:
        """Add queued requests to the engine (waiting for one if asked); False once told to stop."""
        while True:
            try:
                item = self._inbox.get(block=wait)
            except queue.Empty:
                return True
            if item is None:
                return False
            if isinstance(item, _Abort):
                self._abort(item, live)
                wait = not live
                continue
            try:
                if item.family is not None:
                    self._engine.declare_family(*item.family)
                for request, _ in item.requests:
                    self._engine.add_request(request)
            except KMeshError as error:
                # NOTE: in practice only the first request is refused (the forks are the
                # trunk's); any added before it run on unheard, and the family is let go.
                if item.family is not None:
                    self._engine.close_family(item.family[0])
                for _, waiting in item.requests:
                    waiting.post(error)
            else:
                live.update((request.request_id, waiting) for request, waiting in item.requests)
            wait = False

    def _abort(self, abort: _Abort, live: dict[str, _Live]) -> None:
        if abort.family is not None:
            with contextlib.suppress(ContractError):  # refused at admission: already let go
                self._engine.close_family(abort.family)
        for request_id in abort.request_ids:
            if live.pop(request_id, None) is not None:
                self._engine.abort(request_id)
        self._publish_load()

    def _publish_load(self) -> None:
        engine = self._engine
        self._load = EngineLoad(
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            kv_usage=engine.kv.num_blocks_in_use / engine.kv.pool.num_blocks,
            computed_tokens=engine.counters.computed_tokens,
        )

    def _step(self, live: dict[str, _Live]) -> None:
        ended = {output.request_id: output for output in self._engine.step()}
        self._publish_load()
        for request_id, request in list(live.items()):
            output = ended.get(request_id)
            if output is not None:
                request.post(_last_delta(output, request))
                del live[request_id]
                continue
            token_ids = self._engine.output_ids(request_id)
            if len(token_ids) > request.num_sent:
                sent = request.num_sent
                logprobs: tuple[TokenLogprob, ...] = ()
                if request.logprobs:
                    logprobs = _logprobs(*self._engine.output_logprobs(request_id, sent))
                request.post(Delta(token_ids[sent:], logprobs=logprobs))
                request.num_sent = len(token_ids)


def _described(error: BaseException) -> str:
    """What failed, for clients: the kind of error only (its details are in the server log)."""
    return f"the reference engine failed ({type(error).__name__})"


def _failed(error: BaseException) -> EngineStoppedError:
    return EngineStoppedError(
        f"{_described(error)}; the server log has the details: restart kmesh serve"
    )


def _last_delta(output: RequestOutput, request: _Live) -> Delta:
    stats: dict[str, Any] = {name: getattr(output.stats, name) for name in STAT_NAMES}
    if output.stats.recovery is not None:
        stats["recovery"] = output.stats.recovery
    if output.stats.quality is not None:
        stats["quality"] = output.stats.quality
    if output.stats.kept_output_tokens:  # as vLLM's connector reports it
        stats["kept_output_tokens"] = output.stats.kept_output_tokens
    sent = request.num_sent
    logprobs = _logprobs(output.logprobs, output.top_logprobs) if request.logprobs else ()
    return Delta(output.output_ids[sent:], output.finish_reason, stats, logprobs[sent:])


def _logprobs(chosen: tuple[float, ...], top: tuple[Any, ...]) -> tuple[TokenLogprob, ...]:
    """Per output token; `top` is empty when the job asked for none."""
    return tuple(TokenLogprob(logprob, top[i] if top else ()) for i, logprob in enumerate(chosen))
