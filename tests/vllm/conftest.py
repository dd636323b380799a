"""vLLM engines run in a child process per test module (vLLM spawns workers: a job file needs a
main guard), which writes its findings as JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB_TIMEOUT_S = 900


def run_job(name: str, out: Path) -> dict:
    """Run tests/vllm/NAME (`python NAME OUT_DIR`) and return its OUT_DIR/result.json."""
    job = Path(__file__).with_name(name)
    done = subprocess.run(
        [sys.executable, str(job), str(out)], capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result: dict = json.loads((out / "result.json").read_text())
    return result


@pytest.fixture(scope="module")
def job_result(request, tmp_path_factory) -> dict:
    """The result of the module's JOB (a module-level name: the job file)."""
    name = request.module.JOB
    return run_job(name, tmp_path_factory.mktemp(name.removesuffix(".py")))
