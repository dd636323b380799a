"""KMeshConnector inside real vLLM 0.32 at tensor_parallel_size=2 on the CPU backend (each worker
bound to one core), against plain vLLM at the same parallel size: Qwen 2.5's tiny random model (4
query heads, 2 KV heads: one per worker) in the default suite, Gemma 3 270M (one KV head, which
vLLM replicates on both workers) with -m gemma. tp_job.py says what each engine runs: a fork with
exact prefix sharing and page tails, a kept tail, and a restore from the store (into the same
engine after its caches were dropped for the tiny model; into a second engine for Gemma: the
suite's budget has no room for a third TP engine start), on English text; every worker copies
its shard, the first rank writes the stored entries.

Greedy tokens must equal plain vLLM's exactly (float32, one engine's kernels on both sides).
Recovery does not run under tensor parallelism (tests/vllm/test_recovery_support.py: refused up
front, vLLM computes); an entry stored at another parallel size is refused by its meta
(tests/vllm/test_connector_sides.py). Measured on 2 cores: the tiny model's job about 35 s (one
engine start), Gemma 3 270M's 74 s (two).
"""

import pytest

from kmesh.vllm.config import DEFAULT_BLOCK_SIZE
from tests.vllm.conftest import run_job
from tests.vllm.families_job import BRANCHES, SUFFIX, TRUNK

pytestmark = [pytest.mark.model, pytest.mark.vllm]

MODELS = ["qwen2", pytest.param("gemma-3-270m", marks=pytest.mark.gemma)]
TRUNK_PAGES = TRUNK // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE


@pytest.fixture(scope="module")
def results(request, family_folder, tmp_path_factory) -> dict:
    """Every model this session selected from this module, in one job."""
    from kmesh.compute.packaged import ensure_packaged_model

    selected = {
        item.callspec.params["model"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }
    folders = {
        "qwen2": lambda: family_folder("qwen2"),
        "gemma-3-270m": lambda: ensure_packaged_model("gemma-3-270m"),
    }
    specs = [f"{name}={folders[name]()}" for name in ("qwen2", "gemma-3-270m") if name in selected]
    args = [*specs, "--second-engine", "gemma-3-270m"]
    return run_job("tp_job.py", tmp_path_factory.mktemp("tp"), all_cores=True, args=args)


@pytest.fixture
def result(results, model) -> dict:
    return results[model]


@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_equal_plain_vllms_at_the_same_parallel_size(result):
    for name, got in result["kmesh"].items():
        want = result["plain"]["b1" if name == "restored" else name]
        assert got["ids"] == want["ids"], name
    for got in result["plain"].values():
        assert got["reused_tokens"] == got["restored_tokens"] == 0
        assert got["computed_tokens"] == got["prompt_tokens"]


@pytest.mark.parametrize("model", MODELS)
def test_fork_branches_share_the_trunks_pages_and_page_tail_on_every_worker(result):
    assert result["kmesh"]["b0"]["computed_tokens"] == TRUNK + SUFFIX
    shared = result["shared"]  # the trunk and the questions' common start
    assert TRUNK <= shared < TRUNK + SUFFIX
    for b in range(1, BRANCHES):
        got = result["kmesh"][f"b{b}"]
        assert got["reused_tokens"] == shared and got["page_tail_tokens"] == shared - TRUNK_PAGES
        assert got["computed_tokens"] == TRUNK + SUFFIX - shared
    extend = result["kmesh"]["extend"]
    assert extend["page_tail_tokens"] > 0
    assert extend["computed_tokens"] < extend["prompt_tokens"] - TRUNK


@pytest.mark.parametrize("model", MODELS)
def test_the_trunk_is_restored_from_every_workers_shards(result):
    restored = result["kmesh"]["restored"]
    assert restored["restored_tokens"] == TRUNK_PAGES
    assert restored["computed_tokens"] == restored["prompt_tokens"] - TRUNK_PAGES
