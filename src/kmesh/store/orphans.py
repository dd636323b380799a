"""Segments a dead store left in /dev/shm, freed by the next store to start.

A store names its segments `kmesh-<pid namespace>-<pid>-<random>-...` (`segment_prefix`). A
segment is an orphan when its pid namespace is this process's and no process has its pid: its
store died without unlinking it (SIGKILL of the store's whole process group, its resource tracker
included). Never touched: segments of a live pid (a reused pid keeps a dead store's segments
until that process ends, which errs on the safe side), of another pid namespace (whose processes
cannot be seen from here), names of any other shape (other programs, older stores), and what
this user may not unlink (another user's, in a sticky /dev/shm). A client that still maps an
orphan keeps reading it; the memory is freed at its last close.
"""

import os
import re
import secrets
from pathlib import Path

_ORPHAN = re.compile(r"kmesh-(\d+)-(\d+)-[0-9a-f]{8}-[0-9a-f]+")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: every store is taken to share one namespace
        return 0


def segment_prefix() -> str:
    """The start of every segment name of a store running in this process."""
    return f"kmesh-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(4)}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def reclaim_orphans(shm_dir: Path) -> tuple[int, int]:
    """Unlink the orphans in `shm_dir` (module docstring): (segments, bytes) freed."""
    if not shm_dir.is_dir():
        return 0, 0
    namespace, count, size = _pid_namespace(), 0, 0
    for path in shm_dir.iterdir():
        match = _ORPHAN.fullmatch(path.name)
        if match is None or int(match[1]) != namespace or _alive(int(match[2])):
            continue
        try:
            freed = path.stat().st_size
            path.unlink()
        except OSError:  # freed by someone else meanwhile, or another user's (sticky /dev/shm)
            continue
        count, size = count + 1, size + freed
    return count, size
