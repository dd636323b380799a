"""Shared factories: a tiny random Llama for exactness, the embedded model for real outputs."""

import subprocess
import sys

import pytest
import torch

from kmesh.compute.executor import Executor
from kmesh.compute.loader import LoadedModel, load_model
from kmesh.compute.tiny import tiny_executor
from kmesh.engine.engine import Engine


@pytest.fixture(scope="session")
def tiny() -> tuple[Executor, str]:
    return tiny_executor(seed=0)


@pytest.fixture
def make_tiny_engine(tiny):
    def make(**options) -> Engine:
        executor, fingerprint = tiny
        return Engine(executor, fingerprint, **options)

    return make


@pytest.fixture(scope="session")
def real_model() -> LoadedModel:
    """The embedded default model in float32 (converted from the GGUF on first use)."""
    return load_model()


def random_tokens(n: int, seed: int, low: int = 3, high: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=gen).tolist()


def run_kmesh(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """The `kmesh` command in a new process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kmesh.cli", *args], capture_output=True, text=True, timeout=timeout
    )
