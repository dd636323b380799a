"""KMeshConnector inside real vLLM 0.32 on CPU (the embedded model, float32): exactness against
vanilla vLLM, restoration from the store after the prefix cache is reset, and isolation of
cache_salt and LoRA adapters. The engines run in one child process (connector_job.py)."""

import pytest

from kmesh.vllm.config import DEFAULT_BLOCK_SIZE
from tests.vllm.conftest import shared_job
from tests.vllm.connector_job import TRUNK_TOKENS

pytestmark = [pytest.mark.model, pytest.mark.vllm]


@pytest.fixture(scope="module")
def job_result(tmp_path_factory) -> dict:
    """connector_job.py's result, from the embedded model's shared job (embedded_job.py)."""
    return shared_job("embedded_job.py", tmp_path_factory)["connector"]


@pytest.fixture(scope="module")
def result(job_result) -> dict:
    return job_result


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
    # vLLM's pages are forgotten; the connector's page tail of the batch's identical prompt
    # gives the rows after the trunk's whole pages but the last.
    assert (
        got["reused_tokens"] == got["page_tail_tokens"] == got["prompt_tokens"] - 1 - TRUNK_TOKENS
    )
    assert got["restored_tokens"] == TRUNK_TOKENS
    assert got["computed_tokens"] == 1
    cleared = result["restored_without_tails"]  # reset_prefix_cache(reset_connector=True)
    assert (cleared["reused_tokens"], cleared["restored_tokens"]) == (0, TRUNK_TOKENS)
    assert "page_tail_tokens" not in cleared
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
        # whole blocks only: vLLM's kernels compute the partial last one (policy full)
        claimed = (got["prompt_tokens"] - 1) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
        assert got["recovered_tokens"] == claimed
        assert got["computed_tokens"] == got["prompt_tokens"] - claimed
    assert result["recovery_full"]["a"]["recovered_tokens"] == TRUNK_TOKENS


def test_recovery_after_a_local_hit_reads_the_exact_prefix_back_from_vllms_pages(result):
    got = result["recovery_after_local_hit"]
    half = TRUNK_TOKENS // 2
    assert (got["reused_tokens"], got["recovered_tokens"]) == (half, half)
    # Only the claimed tokens are computed by KMesh's executor (on vLLM's own modules).
    assert got["recovery"]["computed_tokens"] == half
    assert got["ids"] == result["vanilla"]["a"]


def test_the_first_reader_of_a_segment_computes_it_and_matches_vanilla(result):
    got = result["first_reader"]
    assert got["recovered_tokens"] == got["prompt_tokens"] - 1
    assert got["recovery"]["reused_tokens"] == 0
    assert got["ids"] == result["vanilla"]["a"]


def test_approximate_state_is_never_served_to_a_request_that_did_not_ask_for_it(result):
    approximate = result["approximate"]
    # The stored halves were reused at swapped positions, nothing of them recomputed (only the
    # question's rows are computed, by KMesh's executor).
    assert approximate["recovered_tokens"] == approximate["prompt_tokens"] - 1
    assert approximate["recovery"]["reused_tokens"] == TRUNK_TOKENS
    assert (
        approximate["recovery"]["computed_tokens"] == approximate["recovered_tokens"] - TRUNK_TOKENS
    )
    # Those blocks sit in vLLM's prefix cache under the approximate salt only: no local hit
    # (the exact request may take the partial page an exact one left: a page tail).
    for name in ("exact_after", "other_salt_after"):
        got = result[name]
        assert got["reused_tokens"] == got.get("page_tail_tokens", 0) < DEFAULT_BLOCK_SIZE, name
    assert result["exact_after"]["ids"] == result["vanilla"]["swapped"]
    same = result["same_salt_after"]
    assert same["reused_tokens"] == TRUNK_TOKENS and same["ids"] == approximate["ids"]


def test_the_gate_falls_back_to_vllms_own_prefill(result):
    got = result["gated"]
    assert got["recovery"]["fell_back"] and got["recovery"]["deviation"] > 0
    assert got["recovered_tokens"] == 0
    assert got["computed_tokens"] == got["prompt_tokens"]
    assert got["ids"] == result["vanilla"]["swapped"]


def test_approximate_recovery_without_an_approximate_salt_is_computed_exactly(result):
    got = result["refused"]
    assert "refused" in got["recovery"] and got["recovered_tokens"] == 0
    assert got["ids"] == result["vanilla"]["swapped"]


@pytest.mark.parametrize("target", ["exact", "greedy"])
def test_a_quality_target_served_exactly_gives_vanilla_vllms_tokens_and_says_so(result, target):
    got = result[f"quality_{target}"]
    assert got["quality"]["target"] == target and got["quality"]["served"] == "exact"
    assert ("reason" in got["quality"]) == (target == "greedy")
    assert "recovery" not in got and got["recovered_tokens"] == 0
    assert got["ids"] == result["vanilla"]["swapped"]


def test_a_kept_output_is_reused_by_a_later_reader_as_its_authors_kv(result):
    author, reader = result["kept_author"], result["kept_reader"]
    generated = len(author["ids"])
    assert author["kept_output_tokens"] == generated - 1  # its last token was never fed back
    # The reader's segment wraps the output in a header: the header is computed, the output's
    # fed-back tokens are the author's KV, re-rotated to the reader's positions.
    assert reader["recovery"]["reused_tokens"] == generated - 1
