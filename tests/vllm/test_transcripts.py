"""A second vLLM instance on another "machine" restores an agent's transcript through the remote
tier: instance A runs a council's rounds with KMeshConnector on store A and publishes each
member's transcript as it recovers it (store/shared/transcripts.py); store A writes it through to
the remote tier (Mooncake Store); instance B, started fresh on store B, serves the member's next
round from it. The engines run in one child process (transcript_job.py)."""

import json

import pytest

from kmesh.compute.config import ModelConfig
from kmesh.compute.loader import resolve_model_dir
from tests.vllm.conftest import shared_job

pytestmark = [pytest.mark.model, pytest.mark.vllm]


@pytest.fixture(scope="module")
def job_result(tmp_path_factory) -> dict:
    """transcript_job.py's result, from the embedded model's shared job (embedded_job.py)."""
    return shared_job("embedded_job.py", tmp_path_factory)["transcript"]


def test_the_second_instance_gives_the_first_instances_greedy_tokens(job_result):
    assert job_result["second"]["ids"] == job_result["first"]["ids"]


def test_the_second_instance_restores_the_transcript_and_computes_the_instruction(job_result):
    got = job_result["second"]
    report = got["recovery"]
    assert got["reused_tokens"] == 0  # a fresh instance: nothing in its prefix cache
    # Every row before the instruction came from the store (A's pieces, checked by digest) ...
    before_instruction = job_result["prompt_tokens"] - job_result["instruction_tokens"]
    assert report["restored_tokens"] == before_instruction
    # Read: its pieces and the two rounds' masters, no more than 1.1x the rows' dense bytes
    # (float32 K and V of every layer); a master entry holds no block padding.
    config = ModelConfig.from_hf(json.loads((resolve_model_dir(None) / "config.json").read_text()))
    dense = before_instruction * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert dense <= report["restored_bytes"] <= 1.1 * dense
    # ... so KMesh computed the instruction but its last token, which vLLM computes.
    assert report["computed_tokens"] == job_result["instruction_tokens"] - 1
    assert got["computed_tokens"] == 1


def test_the_first_instance_reads_nothing_its_own_memory_holds(job_result):
    got = job_result["first"]
    report = got["recovery"]
    # Its prefix cache holds the transcript's whole pages, its kept tail the rest: no read.
    assert got["reused_tokens"] > 0 and report["tail_tokens"] > 0
    assert report["restored_tokens"] == report["restored_bytes"] == 0


def test_members_pin_their_transcripts_while_their_engine_runs(job_result):
    # Rounds 2 and 3 declare each member's next use: its pieces and its round's master stay
    # pinned for the council while instance A runs; A's end lets them go.
    assert job_result["pinned_while_a_runs"] > 0
    assert job_result["pinned_after_a_stopped"] == 0


def test_another_salt_restores_nothing_of_it(job_result):
    report = job_result["other_salt"]["recovery"]
    assert report["restored_tokens"] == 0 and job_result["other_salt"]["reused_tokens"] == 0
