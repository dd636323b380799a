"""A request's `n` completions (kmesh serve): each one generated, decoded and cut at its stop
strings, the branches after the first sharing its prompt through the engine's prefix cache."""

import asyncio
from contextlib import aclosing
from dataclasses import dataclass, replace

from kmesh.engine.stop_strings import StopFilter
from kmesh.serve.backend import Backend, Delta, GenerationJob, TokenLogprob
from kmesh.serve.detokenizer import IncrementalDecoder


@dataclass(frozen=True, slots=True)
class Branch:
    text: str
    finish_reason: str
    last: Delta
    token_ids: tuple[int, ...]
    # With job.logprobs: one per token.
    logprobs: tuple[TokenLogprob, ...]


async def run_branches(backend: Backend, job: GenerationJob, n: int) -> list[Branch]:
    """`n` completions of the job (seeds job.seed, +1, ...). The first runs alone until its
    first token, when its prompt's blocks are in the engine's prefix cache; the others then
    start and reuse them (each computes its prompt's partial last block)."""
    first_token = asyncio.Event()
    first = asyncio.create_task(_branch(backend, job, first_token))
    if n == 1:
        return [await first]
    started = asyncio.create_task(first_token.wait())
    await asyncio.wait([first, started], return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    if first.done() and first.exception() is not None:
        await first  # refused before its first token: the request's error
    seeds = [None if job.seed is None else job.seed + i for i in range(1, n)]
    others = [_branch(backend, replace(job, seed=seed), None) for seed in seeds]
    return [await first, *await asyncio.gather(*others)]


async def _branch(
    backend: Backend, job: GenerationJob, first_token: asyncio.Event | None
) -> Branch:
    decoder = IncrementalDecoder(backend.tokenizer)
    last = Delta(())
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    async with aclosing(backend.generate(job)) as deltas:
        async for last in deltas:
            decoder.add(last.token_ids)
            token_ids += last.token_ids
            logprobs += last.logprobs
            if first_token is not None:
                first_token.set()
    stop = StopFilter(job.stop)
    text = stop.feed(decoder.take_rest()) + stop.flush()
    assert last.finish_reason is not None and last.stats is not None, "a backend ended a job early"
    reason = "stop" if stop.stopped else last.finish_reason
    return Branch(text, reason, last, tuple(token_ids), tuple(logprobs))
