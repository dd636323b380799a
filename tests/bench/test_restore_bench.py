"""`kmesh bench restore` on the tiny model: restores everything stored, singleflight across
engine processes (exactly one computes, the others restore, all outputs identical)."""

from kmesh.bench.restore import TINY, run_restore_bench
from tests.conftest import run_kmesh


def test_restore_bench_and_singleflight_across_engine_processes():
    report = run_restore_bench(TINY, [64, 256], clients=4)
    for row in report["sizes"]:
        assert row["restored_tokens"] == row["tokens"] == row["blocks"] * 16
        assert row["restore_shm_seconds"] > 0 and row["restore_socket_seconds"] > 0
        assert row["recompute_seconds"] is not None
    together = report["concurrency"]
    assert together["clients"] == 4
    assert together["computed"] == 1 and together["restored"] == 3
    assert together["outputs_identical"]


def test_bad_sizes_are_refused():
    ran = run_kmesh("bench", "restore", "--tokens", "1024,lots", "--json", "/tmp/unused.json")
    assert ran.returncode == 2 and "--tokens" in ran.stderr and "Traceback" not in ran.stderr
