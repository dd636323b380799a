"""vLLM engines run in a child process per test module (vLLM spawns workers: a job file needs a
main guard), which writes its findings as JSON."""

import fcntl
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


def shared_job(name: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The result of tests/vllm/NAME run once per test run, by whichever pytest process asks
    first; the others wait on its lock and read the same result (under pytest-xdist every
    process's temporary folder sits in the run's one folder). A failed job fails every module
    that reads it with the job's output, without running it again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    stem = name.removesuffix(".py")
    out, failed = root / f"shared-{stem}", root / f"shared-{stem}.failed"
    with (root / f"shared-{stem}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            pytest.fail(failed.read_text(), pytrace=False)
        if not (out / "result.json").exists():
            out.mkdir(exist_ok=True)
            try:
                return run_job(name, out)
            except AssertionError as error:
                failed.write_text(f"{name} failed:\n{error}")
                raise
    result: dict = json.loads((out / "result.json").read_text())
    return result


@pytest.fixture(scope="module")
def job_result(request, tmp_path_factory) -> dict:
    """The result of the module's JOB (a module-level name: the job file), on all cores where the
    module says JOB_ALL_CORES = True."""
    name = request.module.JOB
    all_cores = getattr(request.module, "JOB_ALL_CORES", False)
    return run_job(name, tmp_path_factory.mktemp(name.removesuffix(".py")), all_cores)
