"""KMeshConnector inside real vLLM 0.32 on CPU (the embedded model, float32): exactness against
vanilla vLLM, restoration from the store after the prefix cache is reset, and isolation of
cache_salt and LoRA adapters. The engines run in one child process (connector_job.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.connector_job import TRUNK_TOKENS

pytestmark = [pytest.mark.model, pytest.mark.vllm]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("connector")
    job = Path(__file__).with_name("connector_job.py")
    done = subprocess.run(
        [sys.executable, str(job), str(out)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((out / "result.json").read_text())


def test_greedy_outputs_equal_vanilla_vllm(result):
    for name, got in result["batch"].items():
        assert got["ids"] == result["vanilla"][name], name
        assert got["prompt_tokens"] == got["computed_tokens"] + got["reused_tokens"]


def test_stats_show_local_prefix_reuse_of_the_shared_trunk(result):
    batch = result["batch"]
    # One of the three trunk prompts computes the trunk; vLLM's prefix cache shares it.
    assert sorted(batch[n]["reused_tokens"] for n in "abc") == [0, TRUNK_TOKENS, TRUNK_TOKENS]


def test_after_reset_prefix_cache_the_trunk_is_restored_from_the_store(result):
    got = result["restored"]
    assert got["reused_tokens"] == 0
    assert got["restored_tokens"] == TRUNK_TOKENS  # 16 blocks of 128
    assert got["computed_tokens"] == got["prompt_tokens"] - TRUNK_TOKENS
    assert got["ids"] == result["vanilla"]["a"]


def test_a_salt_never_loads_another_salts_state(result):
    first_a, b, second_a = result["salt"]
    # The store holds the trunk without a salt (from the batch): salt A may not load it.
    assert first_a["restored_tokens"] == 0
    assert b["restored_tokens"] == 0  # A's blocks are not B's
    assert second_a["restored_tokens"] == TRUNK_TOKENS  # A's own blocks are
    assert first_a["ids"] == b["ids"] == second_a["ids"] == result["vanilla"]["a"]


def test_an_adapter_never_loads_the_base_models_or_another_adapters_state(result):
    first_x, y, second_x = result["lora"]
    assert first_x["restored_tokens"] == 0  # base-model blocks are stored
    assert y["restored_tokens"] == 0  # x's blocks are stored
    assert second_x["restored_tokens"] == TRUNK_TOKENS
    assert first_x["ids"] == second_x["ids"] == result["vanilla_lora_x"]
    # The adapters change the model: loading the wrong state would change outputs.
    assert first_x["ids"] != result["vanilla"]["a"]
    assert y["ids"] != first_x["ids"]


def test_recovery_with_policy_full_inside_vllm_gives_vanillas_greedy_outputs(result):
    """The plumbing of recovery: KMesh's executor fills the claimed blocks of vLLM's paged cache
    (CPU layout, K transposed) and vLLM decodes from them."""
    for name, got in result["recovery_full"].items():
        assert got["ids"] == result["vanilla"][name], name
        claimed = (got["prompt_tokens"] - 1) // 128 * 128
        assert got["recovered_tokens"] == claimed
        assert got["computed_tokens"] == got["prompt_tokens"] - claimed
    assert result["recovery_full"]["a"]["recovered_tokens"] == TRUNK_TOKENS
