"""`kmesh bench allgather` output: the console tables, report.md and its plots."""

import copy
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kmesh.bench.allgather.report import TOKEN_LAYERS, print_table, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HARDWARE = "2-core x86_64 CPU, no GPU, torch 2.13.0 (fp32)"
NOTE = "CPU figures are functional/trend results, not comparable to the papers' GPU numbers"
STRATEGIES = ("full", "prefix", "per_request", "collective")


def _quality(kl: float, top1: float, greedy: float) -> dict[str, float | int]:
    return {
        "kl_mean": kl,
        "kl_p95": 3 * kl,
        "top1_agreement": top1,
        "greedy_match_32": greedy,
        "samples": 24,
    }


def _run(tokens: float, seconds: float, kv: int) -> dict[str, Any]:
    return {"computed_tokens": tokens, "prefill_seconds": seconds, "kv_bytes_per_agent": kv}


BASE: dict[str, Any] = {
    "hardware": HARDWARE,
    "note": NOTE,
    "config": {
        "agents": 8,
        "rounds": 3,
        "order": "shuffle",
        "seed": 0,
        "policy": "kv_deviation",
        "recompute_ratio": 0.15,
        "agent_ratio": 0.05,
        "check_layer": 1,
        "block_size": 16,
        "model": "sha256-abc",
        "prompt_tokens": 18000,
    },
    "strategies": {
        "full": {
            **_run(18000.0, 80.1, 1_228_800),
            "fallbacks": 0,
            "quality": _quality(0.0, 1.0, 1.0),
        },
        "prefix": {
            **_run(12000.0, 55.0, 1_228_800),
            "fallbacks": 0,
            "quality": _quality(0.0, 1.0, 1.0),
        },
        "per_request": {
            **_run(4000.0, 20.0, 1_228_800),
            "fallbacks": 1,
            "quality": _quality(2.5e-3, 0.9583, 0.8125),
        },
        "collective": {
            **_run(1200.0, 10.0, 201_000),
            "fallbacks": 0,
            "quality": _quality(3.1e-3, 0.9167, 0.7917),
            "kv_bytes_master": 1_000_000,
            "kv_bytes_mirror_per_agent": 76_000,
            "restore_bit_identical": True,
        },
    },
    "comparison": {
        "computed_collective_over_per_request": 0.3,
        "seconds_collective_over_per_request": 0.5,
        "kv_dense_over_collective": 6.1,
        "kv_dense_over_mirror": 14.2,
        "computed_collective_over_prefix": None,  # no prefix run
        "last_round_computed_over_new": {"full": 9.5, "collective": 1.25},
    },
}

SWEEP = [
    {
        "policy": policy,
        "ratio": ratio,
        "strategy": strategy,
        "computed_tokens": 18000 * ratio,
        "prefill_seconds": 80 * ratio,
        "quality": _quality(0.0 if ratio == 1.0 else 1e-3 / ratio, 0.9, 0.8),
    }
    for policy in ("kv_deviation", "random")
    for ratio in (0.05, 0.15, 1.0)
    for strategy in ("per_request", "collective")
]

SCALING = [
    {
        "agents": agents,
        "strategies": {
            name: _run(1000.0 * agents / (i + 1), 5.0 * agents / (i + 1), 150_000)
            for i, name in enumerate(STRATEGIES)
        },
        "kv_dense_over_collective": 0.8 * agents,
        "kv_dense_over_mirror": 12.0,
    }
    for agents in (2, 4, 8)
]


def _result(*, sweep: bool, scaling: bool) -> dict[str, Any]:
    result = copy.deepcopy(BASE)
    if sweep:
        result["sweep"] = copy.deepcopy(SWEEP)
    if scaling:
        result["scaling"] = copy.deepcopy(SCALING)
        result["strategies"]["collective"]["closed_loop"] = {
            "identical_share_per_round": [1.0, 0.625],
            "common_prefix_mean_per_round": [1.0, 0.8125],
        }
    return result


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > len(PNG_SIGNATURE)
    assert data[:8] == PNG_SIGNATURE


def test_full_report_has_every_section_and_plot(tmp_path):
    out_dir = tmp_path / "new" / "dir"
    path = write_report(_result(sweep=True, scaling=True), out_dir)
    assert path == out_dir / "report.md"
    text = path.read_text()
    assert HARDWARE in text
    assert NOTE in text
    assert TOKEN_LAYERS in text
    assert "2 of 30 layers counts 2/30" in text
    for name in STRATEGIES:
        assert f"| {name} |" in text
    assert "| 1200.0 | 10.00 | 196.3 | 0.0031 | 0.0093 | 0.917 | 0.792 | 0 |" in text
    assert "kv_deviation" in text and "random" in text  # the sweep table
    assert "| 8 |" in text  # the scaling table
    assert "| collective | 1.000 / 0.625 | 1.000 / 0.812 |" in text  # the closed loop
    for figure in ("quality_vs_ratio.png", "compute_storage.png", "scaling.png"):
        assert f"]({figure})" in text
        _assert_png(out_dir / figure)
    for key, value in BASE["config"].items():
        assert f"- {key}: {value}" in text


@pytest.mark.parametrize("scaling", [False, True])
def test_report_without_sweep_has_no_quality_plot(tmp_path, scaling):
    path = write_report(_result(sweep=False, scaling=scaling), tmp_path)
    text = path.read_text()
    assert not (tmp_path / "quality_vs_ratio.png").exists()
    assert "quality_vs_ratio.png" not in text
    _assert_png(tmp_path / "compute_storage.png")
    assert (tmp_path / "scaling.png").exists() == scaling
    assert ("scaling.png" in text) == scaling
    for name in STRATEGIES:
        assert f"| {name} |" in text


def test_print_table_shows_strategies_ratios_and_optional_tables():
    console = Console(record=True, width=200)
    print_table(_result(sweep=True, scaling=True), console)
    text = console.export_text()
    for name in STRATEGIES:
        assert name in text
    assert "8 agents, 3 rounds, order shuffle, policy kv_deviation, recompute ratio 0.15" in text
    for ratio in ("0.30", "0.50", "6.10", "14.20"):
        assert ratio in text
    assert "restore bit-identical: yes" in text
    assert "quality vs recompute ratio" in text
    assert "scaling over agent counts" in text
    assert "KV dense/mirror" in text
    assert "last round's computed tokens / its new tokens: full 9.50, collective 1.25" in text
    assert "closed loop vs full prefill's" in text and "1.000 / 0.625" in text


def test_print_table_without_optional_sections():
    console = Console(record=True, width=200)
    print_table(_result(sweep=False, scaling=False), console)
    text = console.export_text()
    for name in STRATEGIES:
        assert name in text
    assert "6.10" in text
    assert "quality vs recompute ratio" not in text
    assert "scaling over agent counts" not in text
