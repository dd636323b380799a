"""Host staging between the store's shared memory and a worker's KV pages, on any device.

On a GPU, pages are copied through pinned host buffers on a side stream: a save waits for the
compute stream, copies the block's pages into pinned memory and waits for the copy (the host then
writes the entry); a load copies the entry's bytes into pinned memory and from there into the
pages asynchronously, and `wait` makes the compute stream wait for every load of the step before
vLLM's forward pass reads the pages. The pinned buffer of a step's loads is reused next step,
after the side stream has finished with it. On the CPU the pages are host memory already: bytes
are copied directly, and `wait` has nothing to wait for.

A page crosses as bytes in its memory order (Pages.page), so what is stored is the cache's bytes.
"""

from collections.abc import Sequence

import torch


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        pinned = self.stream is not None
        self._saves = torch.empty(0, dtype=torch.uint8, pin_memory=pinned)
        self._loads = torch.empty(0, dtype=torch.uint8, pin_memory=pinned)
        self._used = 0  # bytes of _loads this step's loads occupy

    def to_host(self, pages: Sequence[torch.Tensor]) -> torch.Tensor:
        """The pages' bytes, one after another, in host memory (pinned on a GPU) that the next
        call reuses: write them out before calling again."""
        nbytes = sum(page.numel() * page.element_size() for page in pages)
        if nbytes > self._saves.numel():
            self._saves = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.stream is not None)
        out = self._saves[:nbytes]
        if self.stream is None:
            _copy_out(pages, out)
            return out
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            _copy_out(pages, out, non_blocking=True)
        self.stream.synchronize()
        return out

    def to_pages(self, source: torch.Tensor, pages: Sequence[torch.Tensor]) -> None:
        """Copy host bytes `source` (uint8, the pages' size) into the pages; on a GPU the copy
        runs on the side stream until `wait`."""
        if self.stream is None:
            _copy_in(source, pages)
            return
        if self._used == 0:  # the step's first load: after whatever the compute stream queued
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        staged = self._stage(source)
        with torch.cuda.stream(self.stream):
            _copy_in(staged, pages, non_blocking=True)

    def wait(self) -> None:
        """Have the compute stream wait for this step's loads (before vLLM reads the pages)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._used = 0

    def _stage(self, source: torch.Tensor) -> torch.Tensor:
        """`source` copied into this step's pinned buffer (a larger one, once the copies reading
        this one are done, when it is full)."""
        assert self.stream is not None
        n = source.numel()
        if self._used == 0 or self._used + n > self._loads.numel():
            self.stream.synchronize()  # copies still reading the buffer are done with it
        if self._used + n > self._loads.numel():
            self._loads = torch.empty(
                max(2 * self._loads.numel(), n), dtype=torch.uint8, pin_memory=True
            )
            self._used = 0
        staged = self._loads[self._used : self._used + n]
        staged.copy_(source)
        self._used += n
        return staged


def _copy_out(pages: Sequence[torch.Tensor], out: torch.Tensor, non_blocking: bool = False) -> None:
    offset = 0
    for page in pages:
        n = page.numel() * page.element_size()
        out[offset : offset + n].view(page.dtype).view(page.shape).copy_(page, non_blocking)
        offset += n


def _copy_in(
    source: torch.Tensor, pages: Sequence[torch.Tensor], non_blocking: bool = False
) -> None:
    offset = 0
    for page in pages:
        n = page.numel() * page.element_size()
        page.copy_(source[offset : offset + n].view(page.dtype).view(page.shape), non_blocking)
        offset += n
