"""The `kmesh` command as a user runs it: a real process, real output, clear errors. Bad input
is checked through `kmesh.cli.main` in this process (what `python -m kmesh.cli` runs, without a
Python start and torch import per case)."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from kmesh.cli import main
from kmesh.compute.tiny import TINY_HF_CONFIG
from tests.conftest import run_kmesh as kmesh


def kmesh_in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, stderr) of `kmesh ARGS` run by `kmesh.cli.main`; argparse's exits count.
    An exception other than SystemExit propagates: the user would have seen a traceback."""
    sigterm = signal.getsignal(signal.SIGTERM)  # bench commands set their own
    try:
        status = main(args)
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    return status, capsys.readouterr().err


def test_parsing_any_command_imports_neither_torch_nor_an_engine():
    # Every store and server the benches and tests start is a `kmesh` process: its parser (all
    # commands' flags and defaults) must not cost a torch import (about 1.3 s here).
    probe = (
        "import sys; from kmesh.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.model
def test_generate_answers_paris_as_json():
    result = kmesh(
        "generate", "What is the capital of France?", "--chat", "--max-tokens", "16", "--json"
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert "Paris" in answer["text"]
    stats = answer["stats"]
    assert stats["prompt_tokens"] == stats["computed_tokens"] + stats["reused_tokens"]
    assert len(answer["token_ids"]) == stats["output_tokens"] <= 16


@pytest.mark.model
def test_model_info_names_the_cache_and_config():
    result = kmesh("model", "info", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["config"]["num_layers"] == 30
    assert info["config"]["num_kv_heads"] == 3
    assert info["path"].startswith(info["cache_dir"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens must be a positive"),
        (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
        (["model", "info", "--model", "/no/such/model"], "does not exist"),
        (["bench", "vllm-family", "--instances", "0", "--json", "x.json"], "--instances"),
        (["bench", "vllm-family", "--model", "/no/such/model", "--json", "x.json"], "not exist"),
        (["bench", "lora", "--agents", "4,x", "--json", "x.json"], "--agents takes agent counts"),
        (["bench", "lora", "--agents", "0", "--json", "x.json"], "at least 1"),
        (["bench", "lora", "--context-tokens", "10", "--json", "x.json"], "at least 64"),
        (["adapters", "prepare", "--count", "0"], "--count must be at least 1"),
        (["serve", "--engine", "reference", "--recovery-bytes", "lots"], "--recovery-bytes takes"),
        (["serve", "--engine", "reference", "--quality", "greedy"], "need --reuse-messages"),
        (["serve", "--engine", "reference", "--dtype", "bfloat16"], "it needs --engine vllm"),
        (["serve", "--engine", "reference", "--heap-reserve", "1G"], "it needs --engine vllm"),
        (["serve", "--engine", "reference", "--tensor-parallel-size", "2"], "needs --engine vllm"),
        (["serve", "--engine", "vllm", "--tensor-parallel-size", "2"], "9 attention heads"),
        (["serve", "--engine", "vllm", "--heap-reserve", "some"], "--heap-reserve takes a size"),
        (
            ["serve", "--engine", "reference", "--reuse-messages", "--quality", "kl:x"],
            "--quality takes exact, greedy",
        ),
        (
            [
                *("serve", "--engine", "reference", "--reuse-messages"),
                *("--quality", "greedy", "--reuse-ratio", "0.2"),
            ],
            "give one of them",
        ),
        (["bench", "council", "--quality", "best", "--json", "x.json"], "--quality takes"),
        (["bench", "council", "--ratios", "", "--json", "x.json"], "nothing to run"),
        (["bench", "allgather", "--plot", "f.png", "--json", "x.json"], "needs --frontier"),
        (["bench", "calibrate", "--frontiers", "/no/a.json", "--json", "x.json"], "cannot read"),
        (["serve", "--engine", "reference", "--api-keys", "/no/such/keys"], "--api-keys: cannot"),
        (
            ["store", "serve", "--socket", "/tmp/x", "--capacity", "1M", "--api-keys", "/no/keys"],
            "cannot read",
        ),
        (["bench", "load", "--clients", "0", "--json", "x.json"], "--clients must be at least 1"),
        (["bench", "load", "--engine", "vllm-vanilla", "--json", "x.json"], "takes --mix plain"),
        (
            ["bench", "capacity", "--agents", "4,x", "--json", "x.json"],
            "separated by commas, like 4,8,16",
        ),
        (["bench", "capacity", "--agents", "1", "--json", "x.json"], "at least 2"),
        (["bench", "round", "--siblings", "1", "--json", "x.json"], "at least 2 siblings"),
        (["bench", "round", "--shape", "gpt", "--json", "x.json"], "--shape takes one of"),
        (["bench", "round", "--shape", "tiny", "--model", "m", "--json", "x.json"], "not both"),
        (["bench", "round", "--device", "tpu:x", "--json", "x.json"], "is not a device"),
        (
            ["bench", "round", "--shape", "tiny", "--trunk-tokens", "5000", "--json", "x.json"],
            "past the model's 4096 positions",
        ),
        (["bench", "capacity", "--rounds", "1", "--json", "x.json"], "--rounds must be at least"),
        (
            ["bench", "capacity", "--strategies", "kmesh", "--json", "x.json"],
            "must include vanilla",
        ),
        (
            [
                *("bench", "capacity", "--workload", "trajectory"),
                *("--strategies", "vanilla,kmesh_dense", "--json", "x.json"),
            ],
            "name only vanilla, vanilla_offload, kmesh, kmesh_lru for the trajectory",
        ),
    ],
)
def test_bad_input_gets_one_clear_line_and_no_traceback(args, message, capsys):
    status, stderr = kmesh_in_process(args, capsys)
    assert status == 2
    assert message in stderr
    assert "Traceback" not in stderr


@pytest.mark.model
def test_a_prompt_longer_than_the_context_is_refused(capsys):
    status, stderr = kmesh_in_process(["generate", "word " * 9000], capsys)
    assert status == 2
    assert "context is 8192 tokens" in stderr
    assert "Traceback" not in stderr


@pytest.mark.model
def test_max_tokens_past_the_context_is_refused(capsys):
    status, stderr = kmesh_in_process(["generate", "x", "--max-tokens", "1000000000"], capsys)
    assert status == 2
    assert stderr.strip().splitlines()[-1] == (
        "kmesh: error: max_tokens=1000000000 cannot be greater than the engine's context of 8192 "
        "tokens (prompt and output together). Please request fewer output tokens."
    )
    assert "Traceback" not in stderr


@pytest.mark.model
def test_a_capacity_budget_below_one_request_is_refused_before_anything_runs(capsys):
    args = ["bench", "capacity", "--budget-mib", "64", "--json", "x.json"]
    status, stderr = kmesh_in_process(args, capsys)
    assert status == 2
    assert "--budget-mib 64 does not hold one request's KV at 32 agents" in stderr
    assert "Traceback" not in stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_round_on_cuda_where_torch_sees_none_is_refused(capsys):
    status, stderr = kmesh_in_process(["bench", "round", "--device", "cuda", "--json", "x"], capsys)
    assert status == 2
    assert "torch sees no CUDA device here; use --device cpu" in stderr


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic"}}, "RoPE scaling"),
    ],
)
@pytest.mark.parametrize("command", [["model", "info"], ["generate", "hi"]])
def test_a_model_kmesh_does_not_run_is_refused_in_one_line(
    command, config, message, tmp_path, capsys
):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **config}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    status, err = kmesh_in_process([*command, "--model", str(tmp_path)], capsys)
    assert status == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


# Every command that takes --model and starts vLLM with KMeshConnector, as a user would run it.
VLLM_COMMANDS = (
    ("serve", "--engine", "vllm"),
    ("bench", "fork", "--engine", "vllm", "--mode", "best-of-n", "--json", "x.json"),
    ("bench", "agents", "--agents", "4", "--json", "x.json"),
    ("bench", "allgather", "--engine", "vllm", "--json", "x.json"),
    ("bench", "tasks", "--json", "x.json"),
    ("bench", "lora", "--engine", "vllm", "--json", "x.json"),
    ("bench", "council", "--engine", "vllm", "--json", "x.json"),
    ("bench", "capacity", "--json", "x.json"),
    ("bench", "vllm-family", "--json", "x.json"),
    ("demo",),
)


@pytest.mark.parametrize("command", VLLM_COMMANDS, ids=lambda c: "-".join(c[:2]))
def test_a_model_vllm_cannot_serve_with_kmesh_is_refused_before_any_engine_starts(
    command, family_folder, capsys
):
    """A sliding window on every layer: `kmesh model info`'s refusal, in one line, exit 2, from
    the model's config alone (nothing loaded, no engine started)."""
    folder = family_folder("mistral")
    capsys.readouterr()  # what building it printed
    status, stderr = kmesh_in_process([*command, "--model", str(folder)], capsys)
    assert status == 2
    assert stderr.splitlines() == [
        "kmesh: error: KMeshConnector in vLLM is refused on this mistral model: every layer "
        "attends through a sliding window, so vLLM frees the pages outside it while a request "
        "runs; KMesh reads any page (the reference engine runs it)"
    ]


@pytest.mark.parametrize("engine", ["vllm", "reference"])
def test_a_context_longer_than_the_models_is_refused_before_the_engine_starts(engine, capsys):
    status, stderr = kmesh_in_process(
        ["serve", "--engine", engine, "--max-model-len", "8193"], capsys
    )
    assert status == 2
    assert stderr.splitlines() == [
        "kmesh: error: --max-model-len 8193 is longer than the model's context, 8192 tokens "
        "(max_position_embeddings in its config.json): give at most 8192"
    ]


@pytest.mark.parametrize(
    ("engine", "holds"),
    # 64 MiB of SmolLM2's float32 rows: vLLM's whole 32-token pages less its null page; the
    # reference engine's 16-token blocks, the last one partly filled.
    [("vllm", 1408), ("reference", 1456)],
)
def test_a_context_the_kv_cache_cannot_hold_is_refused_before_the_engine_starts(
    engine, holds, capsys
):
    args = ["serve", "--engine", engine, "--max-model-len", "4096", "--kv-cache", "64M"]
    status, stderr = kmesh_in_process(args, capsys)
    assert status == 2
    assert f"does not fit the KV cache, which holds {holds} tokens" in stderr
