"""kmesh bench lora on the embedded model with two trained adapters of each kind (small context)."""

import pytest

from kmesh.bench.lora.run import LoraBench, LoraBenchConfig, run_lora_bench
from kmesh.compute.lora import load_adapter
from kmesh.recovery.adapter_residual import ResidualConfig

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def bench(real_model, lora_adapters, activated_adapters):
    plain = [load_adapter(p) for p in lora_adapters]
    activated = [load_adapter(p) for p in activated_adapters]
    cfg = LoraBenchConfig(agents=(2,), context_tokens=256, greedy_tokens=8)
    return LoraBench(real_model, plain, activated, cfg)


def test_activated_adapters_compute_the_context_once_and_answer_exactly(bench):
    result = run_lora_bench(bench)
    runs = {name: s["runs"][0] for name, s in result["strategies"].items()}
    exact, activated, residual = runs["exact"], runs["activated"], runs["residual"]
    own = activated["computed_tokens"] - 256
    assert 0 < own < 2 * 40  # each agent's question and invocation only
    assert activated["exact_computed_tokens"] == 2 * 256 + own  # each agent alone, no sharing
    assert activated["outputs_identical_to_exact"] == 1.0
    assert activated["quality"]["top1_agreement"] == 1.0
    assert exact["computed_tokens"] > 2 * 256
    # The residual path shares the base context: a fraction of exact's bytes per agent.
    assert residual["kv_bytes_per_agent"] < 0.8 * exact["kv_bytes_per_agent"]
    assert residual["kv_bytes_private_per_agent"] < 0.2 * exact["kv_bytes_private_per_agent"]
    assert len(residual["gate_deviation"]) == 2 and residual["gate_refused"] == 0


def test_a_gate_that_refuses_every_agent_falls_back_to_the_exact_context(bench):
    exact = bench.exact(2, bench.plain)
    residual = bench.residual(2, ResidualConfig(check_tokens=16, max_deviation=0.0))
    assert residual.extra["gate_refused"] == 2
    assert residual.greedy == exact.greedy
    assert (residual.logits - exact.logits).abs().max() < 1e-3
