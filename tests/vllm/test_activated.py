"""Activated adapters as vLLM loads them and as KMeshConnector reads their requests' names."""

import json

import pytest

from kmesh.errors import InvalidRequestError
from kmesh.vllm.activated import (
    ACTIVATION_FILE,
    activated_lora_request,
    activation_of,
    vllm_adapter_dir,
)

INVOCATION = [7, 8]


def peft_folder(tmp_path, invocation=INVOCATION):
    folder = tmp_path / "adapter"
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16}
    if invocation is not None:
        config["alora_invocation_tokens"] = invocation
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return folder


def test_vllm_loads_an_activated_adapter_from_a_copy_without_its_invocation_field(tmp_path):
    folder = peft_folder(tmp_path)
    target = vllm_adapter_dir(folder)
    assert target == folder / "vllm"
    config = json.loads((target / "adapter_config.json").read_text())
    assert "alora_invocation_tokens" not in config and config["r"] == 8
    assert (target / "adapter_model.safetensors").read_bytes() == b"weights"
    assert json.loads((target / ACTIVATION_FILE).read_text())["invocation_tokens"] == INVOCATION
    assert vllm_adapter_dir(folder) == target  # made once


def test_a_plain_adapter_is_loaded_as_it_is(tmp_path):
    folder = peft_folder(tmp_path, invocation=None)
    assert vllm_adapter_dir(folder) == folder
    request = activated_lora_request("p", 1, folder, [1, 7, 8, 2])
    assert (request.lora_name, request.lora_path) == ("p", str(folder))


def test_a_folder_without_a_config_is_refused_with_the_reason(tmp_path):
    with pytest.raises(InvalidRequestError, match=r"adapter_config\.json"):
        vllm_adapter_dir(tmp_path)


def test_an_activated_request_is_named_with_the_last_occurrence_of_its_invocation(tmp_path):
    folder = peft_folder(tmp_path)
    request = activated_lora_request("a", 3, folder, [1, 7, 8, 2, 7, 8, 5])
    assert request.lora_name == "a@from=4" and request.lora_int_id == 3
    named = activation_of(request.lora_name, request.lora_path, [1, 7, 8, 2, 7, 8, 5])
    assert named is not None and (named.start, named.note) == (4, None)
    assert activation_of("p", str(peft_folder(tmp_path / "plain", None)), [1, 7, 8]) is None


def test_an_activated_adapter_whose_invocation_is_absent_leaves_the_prompt_to_the_base_model(
    tmp_path,
):
    assert activated_lora_request("a", 3, peft_folder(tmp_path), [1, 2, 3]) is None


def test_the_named_start_is_honoured_and_a_mismatch_is_reported(tmp_path):
    path = str(vllm_adapter_dir(peft_folder(tmp_path)))
    moved = activation_of("a@from=2", path, [1, 7, 8, 2, 7, 8, 5])
    assert moved is not None and moved.start == 2
    assert "last occurrence in the prompt is at 4" in (moved.note or "")
    for name in ("a", "a@from=0", "a@from=99", "a@from=x"):
        unnamed = activation_of(name, path, [1, 7, 8, 2])
        assert unnamed is not None and unnamed.start is None
        assert "carries no start" in (unnamed.note or "")


# -- through vLLM (tests/vllm/activated_job.py: trained adapters, a store, the reference engine) --

JOB = "activated_job.py"


@pytest.mark.vllm
@pytest.mark.model
def test_activated_agents_through_vllm_give_their_own_full_prefills_greedy_tokens(job_result):
    assert job_result["activated"]["greedy"] == job_result["reference_greedy"]
    # fp32 on both engines; the executor's base rows and vLLM's kernels differ by rounding only
    assert max(job_result["first_token_kl"]) < 1e-6


@pytest.mark.vllm
@pytest.mark.model
def test_activated_agents_through_vllm_compute_the_context_once(job_result):
    context = job_result["context_tokens"]
    first, second = job_result["activated"]["stats"]
    for stats in (first, second):
        assert stats["activation"]["start"] > context and "note" not in stats["activation"]
    # The first computes the context's base rows (KMesh's executor) and publishes them; the
    # second restores its whole blocks and computes only its own tokens and the context's tail.
    assert first["restored_tokens"] == 0
    assert first["recovered_tokens"] == first["activation"]["start"]
    assert second["restored_tokens"] == context // 32 * 32
    computed = sum(s["computed_tokens"] + s["recovery"]["computed_tokens"] for s in (first, second))
    own = sum(job_result["own_tokens"])
    assert context + own <= computed < context + own + 32  # within a block of the context once


@pytest.mark.vllm
@pytest.mark.model
def test_a_plain_adapter_through_vllm_never_receives_the_base_state_activated_ones_published(
    job_result,
):
    for stats, prompt in zip(
        job_result["plain_same_salt"]["stats"], job_result["prompt_tokens"], strict=True
    ):
        assert stats["restored_tokens"] == stats["reused_tokens"] == 0
        assert stats["computed_tokens"] == prompt and "activation" not in stats
