"""`kmesh bench vllm-family`: 4 requests of one family (1024-token trunk) over two vLLM
instances; with KMeshConnector on one store the trunk is computed once in total, vanilla vLLM
computes it once per instance; greedy outputs are identical."""

import pytest

from kmesh.bench.vllm_family.run import FamilyBenchConfig, run_family_bench

pytestmark = [pytest.mark.model, pytest.mark.vllm]

TRUNK = 1024  # the committed figures (docs/results/vllm-family.json) use 2048 and 8 requests


@pytest.fixture(scope="module")
def report() -> dict:
    return run_family_bench(FamilyBenchConfig(instances=2, requests=4, trunk_tokens=TRUNK))


def test_the_trunk_is_computed_once_across_instances(report):
    assert report["vanilla"]["trunk_computations"] == 2.0
    # Once; page tails (kmesh/vllm/tail_claims.py) may also give a request the first suffix
    # rows an earlier request on its instance shares with it ("#"): then just under 1.
    assert 0.99 <= report["kmesh"]["trunk_computations"] <= 1.0
    assert report["kmesh"]["restored_tokens"] >= TRUNK  # the other instance restored it
    for run in ("vanilla", "kmesh"):
        r = report[run]
        assert (
            r["prompt_tokens"] == r["computed_tokens"] + r["reused_tokens"] + r["restored_tokens"]
        )


def test_outputs_equal_vanilla_vllm(report):
    assert report["outputs_identical"]
    assert all(
        len(r["output_ids"]) == 16 for i in report["kmesh"]["instances"] for r in i["requests"]
    )
