"""Shared factories: a tiny random Llama for exactness, the embedded model for real outputs, a
real store process per test (`python -m kmesh.cli store serve`, killed at teardown)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh.compute.executor import Executor
from kmesh.compute.loader import LoadedModel, load_model
from kmesh.compute.tiny import tiny_executor
from kmesh.engine.engine import Engine
from kmesh.store import StoreClient
from kmesh.store.process import StoreProcess as RunningStore
from kmesh.store.process import start_store as start_running_store


def _one_thread_per_worker() -> None:
    """Under `make test`'s pytest-xdist processes (PYTEST_XDIST_WORKER=gwN), each process and what
    it starts (kmesh commands, servers, vLLM jobs) computes on one thread, vLLM's bound to core N
    modulo the cores: processes of two threads on two shared cores only contend (measured here,
    quiet: a 2-agent `kmesh bench allgather` took 25.9 s on two threads and 25.8 s on one, the
    same JSON)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = "1"
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    torch.set_num_threads(1)


_one_thread_per_worker()


def _offline_engines_in_process() -> None:
    """Offline vLLM engines (`vllm.LLM`) the tests start, here or in the jobs, benches and
    instances they spawn, run vLLM's engine core in the calling process: one Python and vLLM
    import per engine instead of two (measured here, quiet: start to first output 44 s -> 21 s;
    tests/vllm/transcript_job.py 80 s -> 48 s and connector_job.py 135 s -> 91 s, the same
    result.json each). The connector's scheduler and worker sides share the engine core's process
    either way. vLLM's servers (AsyncLLM: `kmesh serve --engine vllm`, `vllm serve`, in
    tests/serve and tests/vllm/test_worker.py) always spawn their engine core, so requests'
    `kmesh` objects and their stats are still checked through vLLM's process boundary."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


_offline_engines_in_process()


def _vllm_helpers_eager() -> None:
    """vLLM compiles a few small helpers with torch inductor on CPU even under enforce_eager (the
    sampled token's logprob rank, `batched_count_greater_than`; random sampling; the vocabulary
    mask of a sharded embedding), once per shape family and process: a C++ build per graph into
    /tmp/torchinductor_root, which on a fresh machine is cold. Measured here, one thread, a tiny
    model's first request with logprobs: 16.9 s cold, 1.9 s with that cache warm, 0.1 s with
    TORCH_COMPILE_DISABLE (the same tokens). The helpers compute the same integers and choices
    eagerly; every engine the suite compares runs under the same setting."""
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


_vllm_helpers_eager()


# Tests marked so run only when `-m` names the marker (`pytest -m families tests/vllm`); `make
# test` leaves them out, to stay within the suite's time.
OPT_IN_MARKERS = {
    "families": "vLLM on the model families beyond the default suite's (tests/vllm/"
    "test_families_vllm.py); select with -m families",
    "gemma": "converts Gemma 3 270M for real (about a minute and 1 GB the first time) and runs "
    "it; select with -m gemma",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, description in OPT_IN_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Opt-in tests (OPT_IN_MARKERS) are left out unless `-m` names their marker. Modules that
    start vLLM run first, each module's tests kept together and in order: under `make test`'s
    processes (`--dist loadfile --no-loadscope-reorder`: xdist would otherwise put the modules
    with most tests first) the longest modules start first, so no process is left alone with one
    at the end."""
    expression = config.getoption("markexpr", "") or ""
    left_out = [
        item
        for item in items
        if any(item.get_closest_marker(m) and m not in expression for m in OPT_IN_MARKERS)
    ]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    starts_vllm = {item.path for item in items if item.get_closest_marker("vllm")}
    items.sort(key=lambda item: item.path not in starts_vllm)


# Figures tests state (`stated`), gathered from every process's reports, printed at the end.
_STATED: list[str] = []


@pytest.fixture
def stated(record_property) -> Callable[[str], None]:
    """`stated(line)`: a figure the test states in pytest's summary, whether it passes or not
    (a measured tolerance beside what it bounds; under pytest-xdist it travels in the report)."""

    def state(line: str) -> None:
        record_property("stated", line)

    return state


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _STATED.extend(str(value) for name, value in report.user_properties if name == "stated")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STATED:
        terminalreporter.section("figures the tests stated")
        for line in _STATED:
            terminalreporter.write_line(line)


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


def rope_pair_norms(keys: torch.Tensor) -> torch.Tensor:
    """Each channel's RoPE pair norm |(k_i, k_{i + d/2})| (float32), on both channels of the pair:
    what a turn preserves, so what bounds a turned element and its rounding error."""
    half = keys.shape[-1] // 2
    norms = keys[..., :half].float().hypot(keys[..., half:].float())
    return torch.cat((norms, norms), dim=-1)


def run_kmesh(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """The `kmesh` command in a new process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kmesh.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def synthetic_allgather_turns(agents: int = 3, rounds: int = 3, order: str = "shuffle"):
    """An All-Gather trace in the shape workloads/allgather.py writes, from random token ids in
    the tiny model's vocabulary (no tokenizer, no generation): system, persona, outputs of earlier
    rounds (header + the author's output ids + a closing token), instruction."""
    from kmesh.state.segments import Role, Segment, SegmentedPrompt
    from kmesh.workloads.allgather import (
        AgentTurn,
        AllGatherConfig,
        order_for,
        output_segment_id,
    )

    cfg = AllGatherConfig(agents, rounds, order)
    system = Segment(tuple(random_tokens(12, seed=100)), Role.SHARED, "system")
    personas = [
        Segment(tuple(random_tokens(5 + 3 * a, seed=200 + a)), Role.PRIVATE, f"persona-{a}")
        for a in range(agents)
    ]
    history: list[list[Segment]] = []
    turns = []
    for r in range(rounds):
        outputs = []
        for a in range(agents):
            segments = [system, personas[a]]
            for past, said in enumerate(history):
                segments += [said[author] for author in order_for(cfg, past, a)]
            ask = tuple(random_tokens(4, seed=300 + 10 * r + a))
            segments.append(Segment(ask, Role.INSTRUCTION, f"ask-{r}-{a}"))
            body = tuple(random_tokens(9 + a, seed=400 + 10 * r + a))
            turns.append(AgentTurn(r, a, SegmentedPrompt.of(segments), body, ""))
            header = (250, 251, 3 + a)
            outputs.append(Segment((*header, *body, 252), Role.SHARED, output_segment_id(r, a)))
        history.append(outputs)
    return turns


@dataclass
class StoreProcess(RunningStore):
    """A test's store process, with a client factory."""

    def client(self, tenant: str | None = None, timeout: float = 5.0) -> StoreClient:
        return StoreClient(self.socket, tenant=tenant, timeout=timeout)


def start_store(directory: Path, capacity: str = "16M", **options: Any) -> StoreProcess:
    """A store process; `options`: those of kmesh.store.process.start_store."""
    running = start_running_store(directory, capacity, **options)
    return StoreProcess(running.socket, running.process, running.log)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path (a Unix socket path must fit in 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="kms-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def store_factory(short_dir: Path) -> Iterator[Callable[..., StoreProcess]]:
    started: list[StoreProcess] = []
    count = 0

    def make(capacity: str = "16M", **options: Any) -> StoreProcess:
        nonlocal count
        count += 1
        directory = short_dir / str(count)
        directory.mkdir()
        store = start_store(directory, capacity, **options)
        started.append(store)
        return store

    yield make
    for store in started:  # all told at once: a store in front of a remote tier takes ~2 s
        if store.process.poll() is None:
            store.process.send_signal(signal.SIGTERM)
    for store in started:
        store.stop()
        assert "internal error" not in store.log_text(), store.log_text()


@pytest.fixture
def store(store_factory: Callable[..., StoreProcess]) -> StoreProcess:
    return store_factory()


@pytest.fixture(scope="session")
def lora_adapters() -> list[Path]:
    """The folders of the first two plain LoRA adapters of the embedded model (trained on first
    use, about 15 s each, then cached)."""
    from kmesh.adapters.prepare import ensure_adapters

    return ensure_adapters("lora", 2)


@pytest.fixture(scope="session")
def activated_adapters() -> list[Path]:
    """The folders of the first two Activated LoRA adapters of the embedded model (trained on
    first use, about 15 s each, then cached)."""
    from kmesh.adapters.prepare import ensure_adapters

    return ensure_adapters("activated", 2)


@pytest.fixture(scope="session")
def family_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`family_folder(name)`: the folder of tests/model_families.py's tiny random model `name`
    (seed 0), built on first use in the session (~0.6 s each) and shared after."""
    from tests.model_families import build_family_folder

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family_folder(name, tmp_path_factory.mktemp(f"family-{name}"))
        return built[name]

    return get
