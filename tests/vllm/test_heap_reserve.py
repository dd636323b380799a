"""The worker's heap reserve (kmesh/vllm/heap_reserve.py), in processes of its own: glibc reads
its settings when a process starts."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from kmesh.vllm import heap_reserve
from kmesh.vllm.config import ALLOCATOR_ENV
from kmesh.vllm.connector import KMeshConnector, heap_reserve_setting
from kmesh.vllm.layout import BlockLayout

# Cold allocation (64 MiB written) as the control, then a 256 MiB reserve, then 192 MiB written.
PROBE = """
import json, torch
from kmesh.vllm import heap_reserve

def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

def written(nbytes):
    before = faults()
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.fill_(2)
    del block
    return faults() - before

cold = written(64 << 20)
kept = heap_reserve.warm(256 << 20)
print(json.dumps({"cold": cold, "kept": kept, "after": written(192 << 20)}))
"""


def _probe(env: dict[str, str]) -> tuple[dict[str, int], str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_under_the_allocator_settings_buffers_after_the_reserve_fault_no_pages():
    env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    seen, _ = _probe(env | ALLOCATOR_ENV)
    assert seen["cold"] > 10_000  # 16,384 pages of 4 KiB written for the first time
    assert seen["kept"] >= (256 - 64) << 20  # the control's freed 64 MiB may be reused
    assert seen["after"] < 1_000  # 49,152 pages, all from the reserve


def test_without_them_the_reserve_is_returned_and_the_log_says_what_to_set():
    env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    seen, stderr = _probe(env)
    assert seen["kept"] < 128 << 20
    assert seen["after"] > 10_000
    assert "ALLOCATOR_ENV" in stderr and "heap_reserve_bytes 0" in stderr


def test_the_default_is_half_the_cache_and_at_most_a_quarter_of_what_is_available(monkeypatch):
    monkeypatch.setattr(heap_reserve, "_available", lambda: 20 << 30)
    assert heap_reserve.default_reserve(4 << 30) == 2 << 30
    monkeypatch.setattr(heap_reserve, "_available", lambda: 4 << 30)
    assert heap_reserve.default_reserve(4 << 30) == 1 << 30
    assert heap_reserve.warm(0) == 0


def test_the_connector_writes_the_reserve_once_vllm_registers_its_kv_cache(monkeypatch):
    warmed: list[int] = []
    monkeypatch.setattr(heap_reserve, "warm", warmed.append)
    monkeypatch.setattr(heap_reserve, "_available", lambda: 64 << 30)
    worker = SimpleNamespace(register_kv_caches=lambda caches, attention: None)
    caches = {name: torch.empty(3 << 20, dtype=torch.uint8) for name in ("layer.0", "layer.1")}
    for given, written in ((None, 3 << 20), (0, 0), (5 << 20, 5 << 20)):
        connector = SimpleNamespace(_worker_side=worker, _heap_reserve=given, _attention={})
        KMeshConnector.register_kv_caches(connector, caches)  # type: ignore[arg-type]
        assert warmed.pop() == written  # by default half the cache's 6 MiB


def test_an_engine_that_cannot_recover_writes_no_reserve_unless_one_is_given():
    layout = BlockLayout(("model.layers.0.self_attn.attn",), 32, 4096, torch.float32, "cpu")

    def transfer(**extra):
        return SimpleNamespace(get_from_extra_config=lambda name, default: extra.get(name, default))

    def parallel(worker_cls):
        return SimpleNamespace(worker_cls=worker_cls, worker_extension_cls="")

    kmesh, plain = parallel("kmesh.vllm.worker.KMeshWorker"), parallel("auto")
    assert heap_reserve_setting(transfer(), kmesh, layout) is None  # the default, sized later
    assert heap_reserve_setting(transfer(), plain, layout) == 0  # recovery refused: no reserve
    assert heap_reserve_setting(transfer(heap_reserve_bytes=7 << 20), plain, layout) == 7 << 20
    assert heap_reserve_setting(transfer(heap_reserve_bytes="0"), kmesh, layout) == 0
