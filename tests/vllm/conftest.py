"""vLLM engines run in a child process per test module (vLLM spawns workers: a job file needs a
main guard), which writes its findings as JSON."""

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

JOB_TIMEOUT_S = 900


def run_job(name: str, out: Path, all_cores: bool = False, args: Sequence[str] = ()) -> dict:
    """Run tests/vllm/NAME (`python NAME OUT_DIR ARGS...`) and return its OUT_DIR/result.json.
    `all_cores`: vLLM's own thread binding (every core) whatever this process's
    (tests/conftest.py gives each pytest-xdist process one thread)."""
    job = Path(__file__).with_name(name)
    env = dict(os.environ)
    if all_cores:
        env.pop("OMP_NUM_THREADS", None)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    done = subprocess.run(
        [sys.executable, str(job), str(out), *args],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result: dict = json.loads((out / "result.json").read_text())
    return result


@pytest.fixture(scope="module")
def job_result(request, tmp_path_factory) -> dict:
    """The result of the module's JOB (a module-level name: the job file), on all cores where the
    module says JOB_ALL_CORES = True."""
    name = request.module.JOB
    all_cores = getattr(request.module, "JOB_ALL_CORES", False)
    return run_job(name, tmp_path_factory.mktemp(name.removesuffix(".py")), all_cores)
