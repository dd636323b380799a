"""`kmesh bench restore --tiers local,remote`: keyed state through the remote tier (Mooncake Store)
between two "machines" (two stores, each with its own shared memory tier) on this one.

It starts a mooncake_master on loopback ports and two stores in front of it. Per prompt size n:
- writer: an engine on store A computes the prompt (greedy, real KV) and publishes its blocks,
  which A writes through to the remote tier;
- remote hit: an engine on store B admits the prompt: B finds the blocks in the remote tier,
  copies them into its own tier, and the engine restores them (timed);
- local hit: the same engine admits it again, now from B's tier (timed);
- outputs: that engine generates from the restored blocks; its greedy tokens must equal the
  writer's (and the recomputing engine's, run by bench/restore/run.py).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kmesh.compute.executor import Executor
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from kmesh.store.process import MasterProcess, StoreProcess, start_store
from kmesh.store.remote.mooncake_tier import MooncakeTier

GREEDY_TOKENS = 8
WRITE_THROUGH_TIMEOUT_S = 120.0


@dataclass
class TwoMachines:
    """A master and two stores in front of it (A writes, B reads), each lending its capacity."""

    master: MasterProcess
    stores: tuple[StoreProcess, StoreProcess]

    @classmethod
    def start(cls, directory: Path, capacity: str) -> "TwoMachines":
        directory.mkdir(exist_ok=True)
        master = MasterProcess(directory)
        master.start()
        stores: list[StoreProcess] = []
        try:
            for name in ("a", "b"):
                (directory / name).mkdir()
                store = start_store(directory / name, capacity, remote=master, remote_lend=capacity)
                stores.append(store)
        except BaseException:
            for store in stores:
                store.stop()
            master.stop()
            raise
        return cls(master, (stores[0], stores[1]))

    @property
    def sockets(self) -> list[str]:
        return [store.socket for store in self.stores]

    def stop(self) -> None:
        for store in self.stores:
            store.stop()
        self.master.stop()


def _generate(engine: Engine, prompt: tuple[int, ...], name: str) -> tuple[list[int], int]:
    request = Request(name, prompt, SamplingParams(max_tokens=GREEDY_TOKENS))
    out = engine.generate([request])[0]
    return list(out.output_ids), out.stats.restored_tokens


def _wait_written(machines: TwoMachines, keys: list[bytes]) -> None:
    """Until the remote tier holds every key (A writes through on its own thread)."""
    probe = MooncakeTier(machines.master.address, machines.master.metadata, "127.0.0.1", 0)
    try:
        deadline = time.monotonic() + WRITE_THROUGH_TIMEOUT_S
        while probe.present([(key, None) for key in keys]) != [True] * len(keys):
            if time.monotonic() > deadline:
                raise RuntimeError("the writer's blocks never reached the remote tier")
            time.sleep(0.05)
    finally:
        probe.close()


def remote_row(
    executor: Executor,
    fingerprint: str,
    machines: TwoMachines,
    prompt: tuple[int, ...],
    block_keys: Callable[[Engine, tuple[int, ...]], list[bytes]],
    restore: Callable[[Engine, tuple[int, ...]], tuple[float, int]],
) -> dict[str, Any]:
    """One size's remote columns (see the module docstring)."""
    tokens = len(prompt) + GREEDY_TOKENS + 64
    a, b = machines.sockets
    writer = Engine(executor, fingerprint, kv_cache_tokens=tokens, store=a)
    written, _ = _generate(writer, prompt, "writer")
    keys = block_keys(writer, prompt)
    writer.close()
    _wait_written(machines, keys)
    reader = Engine(executor, fingerprint, kv_cache_tokens=tokens, store=b)
    remote_seconds, remote_tokens = restore(reader, prompt)
    local_seconds, _ = restore(reader, prompt)
    read, read_restored = _generate(reader, prompt, "reader")
    reader.close()
    return {
        "restore_remote_seconds": round(remote_seconds, 4),
        "restore_local_hit_seconds": round(local_seconds, 4),
        "restored_remote_tokens": remote_tokens,
        "remote_outputs": read,
        "remote_outputs_identical_to_writer": read == written and read_restored > 0,
    }
