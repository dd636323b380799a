"""The store's shared memory segments as a client sees them: mapping one (`map_segment`), filling
a reserved one (`write_segment`), faulting spares' pages in (`touch_segments`), a verified entry
mapped for reading (`Mapped`), and the meta a publish carries (MessagePack bytes its checksum
covers). The bytes never cross the socket.
"""

import mmap
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from kmesh.store.closing import Closing
from kmesh.store.errors import StoreUnavailable
from kmesh.store.protocol import MAX_META_BYTES, checksum
from kmesh.store.tier import SHM_DIR

if TYPE_CHECKING:
    from typing_extensions import Buffer


class Mapped(Closing):
    """A verified entry mapped into this process. `data` is a read-only view of the shared
    memory (no copy); drop every array made from it, then `close` (or use `with`)."""

    __slots__ = ("_mapping", "data", "key", "meta")

    def __init__(
        self,
        key: bytes,
        mapping: mmap.mmap,
        data: memoryview,
        meta: dict[str, Any],
    ) -> None:
        self.key = key
        self.data = data
        self.meta = meta
        self._mapping = mapping

    def close(self) -> None:
        try:
            self.data.release()
            self._mapping.close()
        except BufferError:
            raise BufferError(
                "an array or tensor made from Mapped.data is still alive; copy out and drop it "
                "before closing"
            ) from None


_meta_decoder = msgspec.msgpack.Decoder(dict[str, Any])
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only
_SEGMENT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,254}")


def map_segment(name: str) -> mmap.mmap:
    """Map one of the store's segments read-only (POSIX shared memory, made by the store with
    multiprocessing.shared_memory) from its file in /dev/shm, its pages populated at once
    (MAP_POPULATE: an entry is read whole). SharedMemory(name) would map the same memory, but
    Python 3.11 registers every segment it maps with the process's resource tracker, which
    unlinks it when the process exits (the store owns its segments) and which sibling processes
    share and race on. OSError if it is gone."""
    fd = _open_segment(name, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise OSError(f"segment {name} is empty")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def write_segment(
    name: str, key: bytes, size: int, meta_bytes: bytes, chunks: Iterable["Buffer"]
) -> int:
    """Fill a reserved segment with `chunks`, one after another, `size` bytes in all, and
    return the checksum to commit. The bytes go through the segment's file (pwrite), not a
    mapping: mapping, faulting in and unmapping a segment cost vLLM's worker, whose other
    threads run on every core, 5-10x the copy itself. StoreUnavailable if the segment is gone
    or takes no write; ValueError (nothing committed) if the chunks do not add up to `size`."""
    try:
        fd = _open_segment(name, os.O_WRONLY)
    except OSError as error:
        raise StoreUnavailable(f"the reserved segment is gone: {error}") from None
    try:
        written: list[memoryview] = []
        offset = 0
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if offset + view.nbytes > size:
                raise ValueError(f"the chunks exceed the {size} bytes reserved")
            written.append(view)
            while view.nbytes:
                try:
                    count = os.pwrite(fd, view, offset)
                except OSError as error:  # not expected: its pages were allocated when made
                    raise StoreUnavailable(f"the reserved segment took no write: {error}") from None
                view, offset = view[count:], offset + count
        if offset != size:
            raise ValueError(f"the chunks hold {offset} bytes, {size} were reserved")
        return checksum(key, meta_bytes, *written)
    finally:
        os.close(fd)


_ZEROS = bytes(8 << 20)


def touch_segments(names: Iterable[str], size: int) -> list[str]:
    """Write zeros over spare segments' `size` bytes, so that their pages are faulted in here and
    now, not in a later writer's copy (tier.py: spares); the names of those still there."""
    touched = []
    for name in names:
        try:
            fd = _open_segment(name, os.O_WRONLY)
        except OSError:  # given up by the store meanwhile
            continue
        try:
            offset = 0
            while offset < size:
                chunk = memoryview(_ZEROS)[: min(len(_ZEROS), size - offset)]
                offset += os.pwrite(fd, chunk, offset)
        finally:
            os.close(fd)
        touched.append(name)
    return touched


def _open_segment(name: str, flags: int) -> int:
    if not _SEGMENT_NAME.fullmatch(name):
        raise OSError(f"{name!r:.80} is not a store segment name")
    return os.open(SHM_DIR / name, flags)


def encode_meta(meta: Mapping[str, Any] | None) -> bytes:
    """A publish's meta as the bytes its checksum covers (empty for none)."""
    if not meta:
        return b""
    encoded = msgspec.msgpack.encode(dict(meta))
    if len(encoded) > MAX_META_BYTES:
        raise ValueError(f"meta encodes to {len(encoded)} bytes, the limit is {MAX_META_BYTES}")
    return encoded


def decode_meta(meta_bytes: bytes) -> dict[str, Any] | None:
    """The meta of `encode_meta`'s bytes; None if they do not decode."""
    try:
        return _meta_decoder.decode(meta_bytes) if meta_bytes else {}
    except msgspec.DecodeError:
        return None
