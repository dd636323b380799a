"""`kmesh bench restore`: getting keyed state back from the store vs computing it again.

Per prompt size n (whole blocks of the model's KV, the engine's dtype):
- restore (shared memory): an engine admits an n-token prompt whose blocks the store holds: one
  acquire for the chain of keys, then per block a mapping of its segment, the checksum check and
  one copy into the engine's paged cache (the engine's own path, engine/block_store.py);
- restore (socket copy): the same blocks' bytes sent through a Unix socket (a socketpair between
  two threads) and copied into the cache: what restoring costs when bytes cross a socket;
- recompute: a prefill of the n tokens with the reference engine (only where n fits the model's
  context).
The stored blocks hold random values of the right layout: restoring does not look at values.

With `tiers` local,remote, a remote hit (another machine's blocks through Mooncake Store) and a
local hit after it are timed too, and the outputs compared (bench/restore/remote.py).

Concurrency C: C engine processes send the same uncached prompt at once, each with a store (with
the remote tier: half on each machine's store): singleflight means exactly one computes and
C - 1 restore, with identical outputs.
"""

import multiprocessing
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Column, Table

from kmesh.bench.common import hardware
from kmesh.bench.restore.remote import GREEDY_TOKENS, TwoMachines, remote_row
from kmesh.compute.executor import Executor
from kmesh.compute.loader import load_model
from kmesh.compute.tiny import tiny_executor
from kmesh.engine.engine import Engine
from kmesh.engine.kv_manager import Admission
from kmesh.engine.request import Request, SamplingParams
from kmesh.engine.sequence import Sequence as EngineSequence
from kmesh.kv.block_pool import blocks_for
from kmesh.store import StoreClient
from kmesh.store.process import start_store

TINY = "tiny"  # model spec of the tiny random-weight Llama (tests)


def load_executor(model: str | None) -> tuple[Executor, str]:
    """(executor, fingerprint) for a model folder, the embedded model (None) or TINY."""
    if model == TINY:
        return tiny_executor(seed=0)
    loaded = load_model(model)
    return loaded.executor, loaded.fingerprint


def _prompt(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (n,), generator=generator).tolist())


def _block_keys(engine: Engine, prompt: Sequence[int]) -> list[bytes]:
    """The chained keys of the prompt's full blocks before its last token (what admit looks
    up), computed by the engine's own KV manager."""
    seq = EngineSequence.from_request(Request("keys", tuple(prompt), SamplingParams(max_tokens=1)))
    engine.kv.extend_keys(seq, (len(prompt) - 1) // engine.kv.block_size)
    return [bytes(key) for key in seq.block_keys]


def _publish_random_blocks(socket_path: str, engine: Engine, prompt: Sequence[int]) -> int:
    """Publish the prompt's full blocks with random values in the engine's layout."""
    link = engine.store
    assert link is not None
    keys = _block_keys(engine, prompt)
    block = torch.randn(link.block_shape, dtype=engine.cache.k.dtype).numpy().tobytes()
    with StoreClient(socket_path) as client:
        got = client.acquire(keys)
        for key in got.lead:
            client.publish(key, block, link.meta)
    return len(keys)


def _restore_shm(engine: Engine, prompt: tuple[int, ...]) -> tuple[float, int]:
    seq = EngineSequence.from_request(Request("restore", prompt, SamplingParams(max_tokens=1)))
    started = time.perf_counter()
    admission = engine.kv.admit(seq)
    while admission is Admission.WAIT:  # the store is still fetching it from the remote tier
        admission = engine.kv.admit(seq)
    if admission is not Admission.ADMITTED:
        raise RuntimeError("the engine's cache cannot hold the prompt")
    seconds = time.perf_counter() - started
    restored = seq.num_restored
    engine.kv.free(seq)
    return seconds, restored


def _restore_socket(socket_path: str, engine: Engine, prompt: tuple[int, ...]) -> float:
    """The same blocks, their bytes through a socketpair, copied into the engine's cache."""
    link = engine.store
    assert link is not None
    with StoreClient(socket_path) as client:
        hits = client.acquire(_block_keys(engine, prompt)).hits
    block_ids = engine.kv.pool.allocate(len(hits))
    sender, receiver = socket.socketpair()

    def send() -> None:
        with StoreClient(socket_path) as client, sender:
            for hit in hits:
                with client.read(hit) as entry:
                    sender.sendall(entry.data)

    started = time.perf_counter()
    thread = threading.Thread(target=send)
    thread.start()
    buffer = bytearray(hits[0].size)
    view = memoryview(buffer)
    with receiver:
        for block_id in block_ids:
            received = 0
            while received < len(buffer):
                received += receiver.recv_into(view[received:], len(buffer) - received)
            link.write_block(block_id, view)
    thread.join()
    seconds = time.perf_counter() - started
    engine.kv.pool.release(block_ids)
    return seconds


def _recompute(
    executor: Executor, fingerprint: str, prompt: tuple[int, ...]
) -> tuple[float, list[int]]:
    """Seconds to prefill the prompt without a store, and its greedy continuation."""
    engine = Engine(executor, fingerprint, kv_cache_tokens=len(prompt) + 64)
    started = time.perf_counter()
    engine.generate([Request("recompute", prompt, SamplingParams(max_tokens=1))])
    seconds = time.perf_counter() - started
    request = Request("continue", prompt, SamplingParams(max_tokens=GREEDY_TOKENS))
    return seconds, list(engine.generate([request])[0].output_ids)


def _client(
    model: str | None,
    socket_path: str,
    prompt: tuple[int, ...],
    barrier: Any,
    results: Any,
) -> None:
    """One concurrent engine process: load, wait for all, generate through the store."""
    executor, fingerprint = load_executor(model)
    engine = Engine(executor, fingerprint, kv_cache_tokens=len(prompt) + 64, store=socket_path)
    barrier.wait(timeout=600)
    out = engine.generate([Request(f"c{os.getpid()}", prompt, SamplingParams(max_tokens=8))])[0]
    results.put((out.stats.restored_tokens, out.stats.computed_tokens, list(out.output_ids)))


def concurrency(
    model: str | None, sockets: Sequence[str], prompt: tuple[int, ...], clients: int
) -> dict[str, Any]:
    """`clients` engine processes, one prompt, spread over the stores `sockets` (one per
    machine): who computed, who restored."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(clients)
    results = context.Queue()
    workers = [
        context.Process(
            target=_client, args=(model, sockets[i % len(sockets)], prompt, barrier, results)
        )
        for i in range(clients)
    ]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    answers = [results.get(timeout=900) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    computed = sum(1 for restored, _, _ in answers if restored == 0)
    return {
        "clients": clients,
        "local_tiers": len(sockets),
        "prompt_tokens": len(prompt),
        "computed": computed,
        "restored": clients - computed,
        "outputs_identical": all(a[2] == answers[0][2] for a in answers),
        "seconds_including_model_loads": round(time.perf_counter() - started, 2),
    }


def run_restore_bench(
    model: str | None,
    sizes: Sequence[int],
    clients: int,
    progress: Callable[[str], None] = lambda _: None,
    tiers: Sequence[str] = ("local",),
) -> dict[str, Any]:
    executor, fingerprint = load_executor(model)
    cfg = executor.config
    largest = max(sizes)
    block_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    capacity = str(2 * blocks_for(largest, 16) * block_bytes + (64 << 20))
    remote = "remote" in tiers
    rows = []
    with tempfile.TemporaryDirectory(prefix="kmr-") as directory:
        store = start_store(Path(directory), capacity)
        machines = None
        try:
            if remote:
                machines = TwoMachines.start(Path(directory) / "remote", capacity)
            for n in sizes:
                progress(f"{n} tokens")
                rows.append(
                    _size_row(executor, fingerprint, store.socket, machines, n, block_bytes)
                )
            sockets = [store.socket] if machines is None else machines.sockets
            progress(
                f"concurrency: {clients} engine processes on {len(sockets)} store(s), one "
                f"{sizes[0]}-token prompt"
            )
            prompt = _prompt(sizes[0] + 1, cfg.vocab_size, seed=-1)
            together = concurrency(model, sockets, prompt, clients)
        finally:
            store.stop()
            if machines is not None:
                machines.stop()
    return {
        "hardware": hardware(),
        "note": (
            "CPU figures are functional/trend results; the local restore columns copy "
            "real-sized blocks of random values, the remote ones the writer's real KV; the two "
            "machines are two stores on this one, over loopback TCP"
        ),
        "config": {
            "tokens": list(sizes),
            "concurrency": clients,
            "tiers": list(tiers),
            "model": fingerprint,
        },
        "sizes": rows,
        "concurrency": together,
    }


def _size_row(
    executor: Executor,
    fingerprint: str,
    socket_path: str,
    machines: TwoMachines | None,
    n: int,
    block_bytes: int,
) -> dict[str, Any]:
    cfg = executor.config
    prompt = _prompt(n + 1, cfg.vocab_size, seed=n)
    engine = Engine(executor, fingerprint, kv_cache_tokens=n + 64, store=socket_path)
    blocks = _publish_random_blocks(socket_path, engine, prompt)
    shm_seconds, restored = _restore_shm(engine, prompt)
    socket_seconds = _restore_socket(socket_path, engine, prompt)
    engine.close()
    fits = n + 1 + GREEDY_TOKENS <= cfg.max_position
    recompute, outputs = _recompute(executor, fingerprint, prompt) if fits else (None, None)
    row: dict[str, Any] = {
        "tokens": n,
        "blocks": blocks,
        "restored_tokens": restored,
        "bytes": blocks * block_bytes,
        "restore_shm_seconds": round(shm_seconds, 4),
        "restore_socket_seconds": round(socket_seconds, 4),
        "recompute_seconds": None if recompute is None else round(recompute, 3),
        "recompute_note": None if fits else f"exceeds the model's {cfg.max_position}-token context",
        "recompute_over_restore_shm": None
        if recompute is None
        else round(recompute / shm_seconds, 1),
    }
    if machines is not None and fits:
        remote = remote_row(executor, fingerprint, machines, prompt, _block_keys, _restore_shm)
        remote["remote_outputs_identical"] = (
            remote.pop("remote_outputs_identical_to_writer") and remote["remote_outputs"] == outputs
        )
        del remote["remote_outputs"]
        assert recompute is not None
        remote["recompute_over_restore_remote"] = round(
            recompute / remote["restore_remote_seconds"], 1
        )
        row.update(remote)
    return row


def print_restore(report: dict[str, Any], console: Console) -> None:
    remote = "remote" in report["config"].get("tiers", ["local"])
    names = ["tokens", "MiB", "local hit s", "socket copy s"]
    names += ["remote hit s", "local hit after s"] if remote else []
    names += ["recompute s", "recompute / local"]
    names += ["recompute / remote", "outputs"] if remote else []
    columns = [Column(name, justify="right") for name in names]
    table = Table(*columns, title="bench restore: keyed state from the store vs computing it again")
    for row in report["sizes"]:
        recompute = row["recompute_seconds"]
        cells = [
            str(row["tokens"]),
            f"{row['bytes'] / 2**20:.0f}",
            f"{row['restore_shm_seconds']:.3f}",
            f"{row['restore_socket_seconds']:.3f}",
        ]
        if remote:
            cells += [
                _seconds(row.get("restore_remote_seconds")),
                _seconds(row.get("restore_local_hit_seconds")),
            ]
        cells += [
            "n/a" if recompute is None else f"{recompute:.2f}",
            "n/a" if recompute is None else f"{row['recompute_over_restore_shm']:.0f}x",
        ]
        if remote:
            over = row.get("recompute_over_restore_remote")
            same = row.get("remote_outputs_identical")
            cells += [
                "n/a" if over is None else f"{over:.0f}x",
                "n/a" if same is None else ("identical" if same else "DIFFER"),
            ]
        table.add_row(*cells)
    console.print(table)
    for row in report["sizes"]:
        if row["recompute_note"]:
            console.print(f"{row['tokens']} tokens: recompute n/a, {row['recompute_note']}")
    c = report["concurrency"]
    console.print(
        f"concurrency: {c['clients']} engine processes on {c['local_tiers']} local tier(s), one "
        f"{c['prompt_tokens']}-token prompt: {c['computed']} computed, {c['restored']} restored, "
        f"outputs identical: {'yes' if c['outputs_identical'] else 'NO'}"
    )


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
