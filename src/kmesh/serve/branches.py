"""A request's `n` choices (kmesh serve): branches of one prompt, streamed or whole.

Each backend runs them (`Backend.branches`): the reference engine as a family, the trunk once
and forks copy-on-write; vLLM through `prefix_shared_branches`: the first alone until its first
token, when its prompt's blocks are in the engine's prefix cache, then the others, which reuse
them (each computes its prompt's partial last page). Branch i samples with seed job.seed + i
(None stays None). A branch that fails raises out of the iterator; the others are then cancelled.

`ChoiceText` turns one branch's deltas into what a client sees: text decoded without splitting
a character and cut at the first stop string, the logprobs of the tokens behind each piece, and
the finish reason ("stop" when a stop string ended it).
"""

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from kmesh.engine.stop_strings import StopFilter
from kmesh.serve.backend import Backend, Delta, GenerationJob, TokenLogprob
from kmesh.serve.detokenizer import IncrementalDecoder
from kmesh.serve.logprobs import LogprobsRenderer


@dataclass(frozen=True, slots=True)
class Piece:
    # New text for the client (may be empty on a final delta).
    text: str
    # The logprobs object of the tokens since the previous piece (None: not asked for).
    logprobs: dict[str, Any] | None


class ChoiceText:
    def __init__(self, tokenizer: Any, job: GenerationJob, is_chat: bool) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._stop = StopFilter(job.stop)
        self._tokenizer = tokenizer
        self._is_chat = is_chat
        self._renderer = None if job.logprobs is None else LogprobsRenderer(tokenizer, is_chat)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self._unsent = 0  # tokens whose logprobs are in no piece yet
        self.text = ""
        # The branch's final delta (finish_reason and stats), once it came.
        self.last: Delta | None = None

    def add(self, delta: Delta) -> Piece | None:
        """The piece this delta completes, or None while its text is held back (a character
        or a possible stop string not complete yet); the final delta gives all the rest."""
        self._decoder.add(delta.token_ids)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        if delta.finish_reason is None:
            text = self._stop.feed(self._decoder.take_complete())
            if not text:
                return None
        else:
            self.last = delta
            text = self._stop.feed(self._decoder.take_rest()) + self._stop.flush()
        self.text += text
        logprobs = None
        if self._renderer is not None:
            tokens = slice(self._unsent, len(self.token_ids))
            logprobs = self._renderer.render(self.token_ids[tokens], self.logprobs[tokens])
            self._unsent = len(self.token_ids)
        return Piece(text, logprobs)

    @property
    def finish_reason(self) -> str:
        assert self.last is not None and self.last.finish_reason is not None, "not finished"
        return "stop" if self._stop.stopped else self.last.finish_reason

    def whole_logprobs(self) -> dict[str, Any] | None:
        """The logprobs object of all the choice's tokens (None: not asked for)."""
        if self._renderer is None:
            return None
        return LogprobsRenderer(self._tokenizer, self._is_chat).render(
            self.token_ids, self.logprobs
        )


async def prefix_shared_branches(
    backend: Backend, job: GenerationJob, n: int
) -> AsyncGenerator[tuple[int, Delta], None]:
    """(branch index, delta) of the job's `n` branches as they come, sharing the prompt through
    the prefix cache (module docstring)."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        seed = None if job.seed is None else job.seed + index
        try:
            async with aclosing(backend.generate(replace(job, seed=seed))) as deltas:
                async for delta in deltas:
                    queue.put_nowait((index, delta))
        except Exception as error:  # handed to the iterator's caller
            queue.put_nowait((index, error))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(0))]
    running = 1
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if len(tasks) < n and (item is None or item.token_ids):  # the trunk's blocks are in
                tasks += [asyncio.create_task(pump(i)) for i in range(1, n)]
                running += n - 1
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def run_choices(
    backend: Backend, job: GenerationJob, n: int, is_chat: bool
) -> list[ChoiceText]:
    """The job's `n` choices, whole."""
    choices = [ChoiceText(backend.tokenizer, job, is_chat) for _ in range(n)]
    async with aclosing(backend.branches(job, n)) as deltas:
        async for index, delta in deltas:
            choices[index].add(delta)
    return choices
