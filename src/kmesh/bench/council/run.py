"""`kmesh bench council`: an unmodified agent framework against KMesh and against vanilla vLLM.

AutoGen AgentChat's RoundRobinGroupChat (bench/council/client.py, in the client venv) runs a
council: each agent has its own system message and, every round, reads the task and every
message so far, then speaks. The client is given only a base URL and one default extra body,
`{"cache_salt": SALT}`, the same for every server. Served by:

- `vanilla`: vLLM's own OpenAI server, with prefix caching (each agent reuses its own previous
  request's prefix; another agent's messages sit after a different system message).
- `kmesh`: `kmesh serve --reuse-messages` on either engine. SALT starts with kmesh-approx, so
  every chat's messages are segments and any message another request of the tenant computed (or
  generated) is reused where it now sits, with per-request recovery (`kv_deviation`):
  approximate.

Accounting, per round, from each server's /metrics read between rounds (the client waits):
prompt tokens; computed tokens = rows the engine's prefill computed + rows KMesh's executor
recomputed while recovering (token-equivalents). vLLM: prompt minus its cached tokens. Outputs:
the share of the round's messages identical to vanilla's (closed loop: each run's council
reads its own earlier outputs, so one divergence carries into later rounds).
"""

import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from kmesh.bench.server_metrics import server_counters
from kmesh.errors import InvalidRequestError
from kmesh.serve.process import ServerProcess, start_kmesh_serve, start_vllm_server

CLIENT_SCRIPT = Path(__file__).with_name("client.py")
# The client venv `make clients` builds beside the checkout (clients/autogen.txt).
DEFAULT_CLIENT_PYTHON = Path(__file__).resolve().parents[4] / ".venv-clients" / "bin" / "python"
CLIENT_PYTHON_ENV = "KMESH_CLIENT_PYTHON"
SALT = "kmesh-approx:council"
ROUND_TIMEOUT_S = 1800
TASK = (
    "The council must decide what to do about the old stone bridge over the river. Report of "
    "the town surveyor: the bridge was built one hundred and forty years ago and carries all "
    "traffic between the market square and the farms on the east bank. Two of its five arches "
    "show cracks; the largest crack grew by a finger's width since last spring. Carts heavier "
    "than two tons were banned in the autumn, so the grain now goes the long way round by the "
    "ford, which floods for six weeks each year. Repairing the arches would cost eighty "
    "thousand crowns and close the bridge for four months. A new bridge of steel, one mile "
    "downstream, would cost three hundred thousand crowns and take five years; the old bridge "
    "would stay open, with the weight limit, until then. The town's reserve holds one hundred "
    "and twenty thousand crowns; the duke has offered a loan at five percent. Each member: say "
    "what the council should do, and why, from where you sit."
)


@dataclass(frozen=True, slots=True)
class CouncilConfig:
    agents: int = 8
    rounds: int = 3
    # Greedy tokens per message (the client's max_tokens).
    max_tokens: int = 48
    # Model folder (None: the embedded model).
    model: str | None = None

    def __post_init__(self) -> None:
        for name in ("agents", "rounds", "max_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")


@dataclass(frozen=True, slots=True)
class CouncilRound:
    # The round's messages, in speaking order: {"source": agent name, "content": text}.
    messages: list[dict[str, str]]
    # Counter deltas of the round (the server's /metrics): prompt, computed, and for KMesh
    # reused, restored, recovered, fallbacks.
    counters: dict[str, float]


def client_python(given: str | None) -> Path:
    """The Python that runs the framework: `given`, $KMESH_CLIENT_PYTHON, or the client venv."""
    path = Path(given or os.environ.get(CLIENT_PYTHON_ENV) or DEFAULT_CLIENT_PYTHON)
    if not path.exists():
        raise InvalidRequestError(
            f"no client Python at {path}: AutoGen runs in its own venv (its protobuf pin "
            "conflicts with vLLM's); run `make clients` in the checkout, or pass --client-python"
        )
    return path


def run_council(
    python: Path, url: str, model_id: str, cfg: CouncilConfig, work: Path
) -> list[CouncilRound]:
    """The framework's council against the server at `url`, one CouncilRound per round."""
    spec = {
        "base_url": f"{url}/v1",
        "model": model_id,
        "agents": cfg.agents,
        "rounds": cfg.rounds,
        "max_tokens": cfg.max_tokens,
        "task": TASK,
        "extra_body": {"cache_salt": SALT},
    }
    spec_path = work / "council.json"
    spec_path.write_text(json.dumps(spec))
    log = work / "client.log"
    rounds = []
    with log.open("w") as errors:
        client = subprocess.Popen(
            [str(python), str(CLIENT_SCRIPT), str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        assert client.stdin is not None and client.stdout is not None
        before = server_counters(url)
        for _ in range(cfg.rounds):
            line = client.stdout.readline()
            if not line:
                client.wait(timeout=60)
                raise RuntimeError(f"the council client failed:\n{log.read_text()[-5000:]}")
            after = server_counters(url)
            delta = {k: after[k] - before.get(k, 0.0) for k in after if k != "kv_usage"}
            rounds.append(CouncilRound(json.loads(line)["messages"], delta))
            before = after
            client.stdin.write("\n")
            client.stdin.flush()
        client.stdin.close()
        if client.wait(timeout=ROUND_TIMEOUT_S) != 0:
            raise RuntimeError(f"the council client failed:\n{log.read_text()[-5000:]}")
    return rounds


def _model_id(url: str) -> str:
    [model] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return str(model["id"])


def _served(server: ServerProcess, python: Path, cfg: CouncilConfig, work: Path) -> dict[str, Any]:
    """The council's rounds against a started server, which is then stopped."""
    try:
        rounds = run_council(python, server.url, _model_id(server.url), cfg, work)
    finally:
        server.stop()
    return {"rounds": [r.counters for r in rounds], "messages": [r.messages for r in rounds]}


def run_council_bench(
    cfg: CouncilConfig,
    engine: str,
    ratios: tuple[float, ...],
    python: Path,
    log: Any = print,
    qualities: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Vanilla vLLM, then `kmesh serve --engine ENGINE --reuse-messages` at each --reuse-ratio
    R and each --quality target, on one council; per round, KMesh's counters beside vanilla's
    and the share of its messages identical to vanilla's (module docstring)."""
    from kmesh.vllm.config import vllm_engine_kwargs

    model = [] if cfg.model is None else ["--model", cfg.model]
    settings = [("--reuse-ratio", f"{r:g}") for r in ratios]
    settings += [("--quality", target) for target in qualities]
    with tempfile.TemporaryDirectory(prefix="kmesh-council-") as tmp:
        work = Path(tmp)
        log("vanilla vLLM's server (prefix caching), then the council against it")
        kwargs = vllm_engine_kwargs(cfg.model, connector=False)
        vanilla = _served(start_vllm_server(kwargs, work / "vllm.log"), python, cfg, work)
        runs = []
        for flag, value in settings:
            log(f"kmesh serve --engine {engine} --reuse-messages {flag} {value}, then the council")
            options = ("--reuse-messages", flag, value, *model)
            server = start_kmesh_serve(engine, work / "kmesh.log", options, timeout=400)
            run = _served(server, python, cfg, work)
            run["setting"] = f"{flag.removeprefix('--')} {value}"
            run["identical_to_vanilla"] = [
                sum(a == b for a, b in zip(ours, base, strict=True)) / len(base)
                for ours, base in zip(run["messages"], vanilla["messages"], strict=True)
            ]
            runs.append(run)
    return {
        "config": {**asdict(cfg), "engine": engine, "salt": SALT, "framework": "autogen"},
        "vanilla": vanilla,
        "kmesh": runs,
    }
