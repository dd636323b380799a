"""The store's side of its shared memory segments: making one, freeing one, and keeping a few
made ahead of need (`WarmSegments`).

The first write into fresh memory is the slow part of publishing: the kernel, and on a virtual
machine that hands freed memory back to its host the hypervisor too, faults in every page. On
this project's 2-core VM a 16-agent vLLM run wrote 1.38 GB into fresh segments at 229 MB/s,
against 1.97 GB/s into segments whose pages were touched ahead (docs/STORE.md). A writer is on
its engine's critical path (vLLM's worker saves blocks inside its step), so the store takes
those faults in a thread of its own.

`WarmSegments`' contract:
- `take(size)` never blocks: a warm segment of exactly `size` bytes (zero-filled, its pages
  allocated and touched), or None. Each call makes `size` the one kept warm: the latest asked
  for wins (in practice one engine layout's block size); warm segments of another size are freed.
- It holds at most `target` bytes, and fills only into the tier's free capacity (`headroom()`),
  so warm segments never push an entry out.
- `close()` stops its thread and frees every warm segment; a segment handed out is the taker's.
"""

import logging
import os
import secrets
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_ZEROS = bytes(1 << 20)  # touched once, written from as often as needed


def create_segment(name: str, size: int, touch: bool = False) -> None:
    """A zero-filled segment with its pages allocated (posix_fallocate, on Linux), so writing it
    cannot fail later; `touch`: its pages written too (faulted in). OSError if it cannot be."""
    segment = shared_memory.SharedMemory(name, create=True, size=size)
    try:
        path = SHM_DIR / name
        if path.exists():
            fd = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
                for offset in range(0, size, len(_ZEROS)) if touch else ():
                    os.pwrite(fd, memoryview(_ZEROS)[: size - offset], offset)
            finally:
                os.close(fd)
    except OSError:
        segment.close()
        segment.unlink()
        raise
    segment.close()


def unlink_segment(name: str) -> None:
    try:
        segment = shared_memory.SharedMemory(name)
    except FileNotFoundError:  # already gone (removed by hand, or by a crashed store's tracker)
        return
    segment.close()
    segment.unlink()


class WarmSegments:
    def __init__(self, prefix: str, target: int, headroom: Callable[[], int]) -> None:
        self._prefix = prefix
        self._target = target
        self._headroom = headroom
        self._lock = threading.Lock()
        self._warm: deque[str] = deque()
        self._size = 0  # the size kept warm; 0 until one is asked for
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._fill, name="kmesh-warm-segments", daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """Bytes of warm segments held now."""
        with self._lock:
            return len(self._warm) * self._size

    def take(self, size: int) -> str | None:
        with self._lock:
            stale: list[str] = []
            if size != self._size:
                stale, self._warm, self._size = list(self._warm), deque(), size
            name = self._warm.popleft() if self._warm else None
        for old in stale:
            unlink_segment(old)
        self._wake.set()
        return name

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()
        with self._lock:
            names, self._warm = list(self._warm), deque()
        for name in names:
            unlink_segment(name)

    def _fill(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            while not self._closed:
                with self._lock:
                    size, held = self._size, len(self._warm) * self._size
                if not size or held + size > min(self._target, self._headroom()):
                    break
                name = self._prefix + secrets.token_hex(12)
                try:
                    create_segment(name, size, touch=True)
                except OSError as error:  # /dev/shm is full: writers make their own
                    log.warning("kmesh store: no warm segment of %d bytes: %s", size, error)
                    break
                with self._lock:
                    kept = size == self._size and not self._closed
                    if kept:
                        self._warm.append(name)
                if not kept:
                    unlink_segment(name)
