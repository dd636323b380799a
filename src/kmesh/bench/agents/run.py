"""`kmesh bench agents`: agents served end to end over the OpenAI chat API, as users feel it.

The workloads are workloads/agent_chats.py's (allgather, trajectory, mixed, tasks), closed loop:
each round's messages come from the server under test (tasks: the agents read composed messages
whose facts are known, and the replies are scored: bench/agents/task_scores.py). Every call is a
streamed, greedy chat request carrying what a framework sends (model, messages, max_tokens,
temperature, a cache_salt per run) plus, where the strategy declares, the `kmesh` object
(bench/agents/requests.py). Strategies:
- vllm: vLLM's own OpenAI server with prefix caching (`kmesh vllm serve`), the same engine
  settings and KV cache (with `--engine reference`: `kmesh serve --engine reference`, no
  declarations);
- kmesh_exact, kmesh_per_request, kmesh_collective: `kmesh serve --engine E --store S` (a store
  it starts), one server per strategy as for vllm, each under salts and families of its own.

Per strategy and agent count, every round: makespan (first request sent to last response done),
time to first token of every call (p50, p99 in the JSON), the server's counters (prompt, computed
and recovered tokens, round masters built: bench/server_metrics.py) read before and after it, the
KV cache's use at its end and at its peak (sampled every SAMPLE_S), the store's bytes, failures
(non-200, transport, a stream without [DONE]), and the share of the agents' messages identical to
the vllm strategy's; with tasks, the replies' task accuracy, alone and against vllm's.
`max_agents_under_slo`: the largest agent count such that it and every smaller one held TTFT p99
(over all its rounds' calls) under the SLO. With `serial_check`, vllm's and kmesh_exact's rounds
at the largest count up to SERIAL_CHECK_AGENTS are sent again one call at a time, under fresh
salts (and families), and their texts compared with the concurrent ones.
With `repeats` above 1 the whole pass runs again, servers started afresh each time, so that a
strategy's makespan can be compared with plain vLLM's in the same pass (bench/agents/summary.py).
"""

import asyncio
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kmesh.bench.agents.client import CallResult, send_chat
from kmesh.bench.agents.config import AgentsBenchConfig
from kmesh.bench.agents.requests import RunNames, request_body
from kmesh.bench.agents.summary import agents_report
from kmesh.bench.process_tree import cpu_seconds, cpu_used
from kmesh.bench.server_metrics import server_counters
from kmesh.compute.loader import load_tokenizer, resolve_model_dir
from kmesh.serve.process import ServerProcess, start_kmesh_serve, start_vllm_server
from kmesh.state import chat_codec
from kmesh.store.client import StoreClient
from kmesh.store.process import StoreProcess, start_store
from kmesh.store.server import parse_size
from kmesh.workloads.agent_chats import AgentCall, AgentChats

SAMPLE_S = 1.0
SERIAL_CHECK_AGENTS = 16
# Whose calls the serial check sends again: kmesh_exact's, and plain vLLM's as the control (in
# bfloat16 vLLM's own greedy outputs change with the batch they ran in: docs/design/performance.md).
SERIAL_CHECKED = ("vllm", "kmesh_exact")
REQUEST_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class Served:
    """A strategy's server while it runs: where to send, its store (KMesh), the model's id."""

    url: str
    model_id: str
    store: str | None
    # Role ("server", "store") -> pid: whose CPU time each round reads (bench/process_tree.py).
    processes: dict[str, int]


def run_agents_bench(cfg: AgentsBenchConfig, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Every strategy at every agent count, `cfg.repeats` times (module docstring); the report
    as a JSON-ready dict."""
    tokenizer = load_tokenizer(resolve_model_dir(cfg.model))
    repeats = []
    with tempfile.TemporaryDirectory(prefix="kmesh-agents-") as folder:
        for i in range(cfg.repeats):
            if cfg.repeats > 1:
                log(f"agents: repeat {i + 1} of {cfg.repeats}")
            repeats.append(_repeat(cfg, Path(folder), tokenizer, i == 0, log))
    return agents_report(cfg, repeats)


def _repeat(
    cfg: AgentsBenchConfig, work: Path, tokenizer: Any, first: bool, log: Callable[[str], Any]
) -> dict[str, dict[int, dict[str, Any]]]:
    """One pass over every strategy and agent count, each strategy on a server of its own
    started afresh (no strategy runs on a server another one filled); the serial check in the
    first pass only."""
    runs: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in cfg.strategies}
    nonce = uuid.uuid4().hex[:8]
    # vllm first: the reference for identical messages
    for strategy in ("vllm", *(s for s in cfg.strategies if s != "vllm")):
        server = _vllm_server if strategy == "vllm" else _kmesh_server
        with server(cfg, work) as served:
            for n in cfg.agents:
                log(f"agents: {strategy}, {n} agents x {cfg.rounds} rounds ({cfg.workload})")
                runs[strategy][n] = _run(served, strategy, cfg, n, tokenizer, nonce)
                if first and strategy in SERIAL_CHECKED and n == _serial_agents(cfg):
                    log(f"agents: {strategy}'s {n}-agent calls again, one at a time")
                    runs[strategy][n]["serial_check"] = _serial_check(
                        served, strategy, cfg, runs[strategy][n], nonce
                    )
    return runs


def _serial_agents(cfg: AgentsBenchConfig) -> int | None:
    small = [n for n in cfg.agents if n <= SERIAL_CHECK_AGENTS]
    return max(small) if cfg.serial_check and small else None


class _vllm_server:
    """The vllm strategy's server, stopped on exit."""

    def __init__(self, cfg: AgentsBenchConfig, work: Path) -> None:
        self.cfg, self.work = cfg, work
        self.server: ServerProcess | None = None

    def __enter__(self) -> Served:
        cfg = self.cfg
        if cfg.engine == "reference":
            options: tuple[str, ...] = ("--model", cfg.model) if cfg.model is not None else ()
            if cfg.max_model_len is not None:
                options += ("--max-model-len", str(cfg.max_model_len))
            self.server = start_kmesh_serve("reference", self.work / "plain.log", options)
        else:
            from kmesh.vllm.config import vllm_engine_kwargs

            kwargs = vllm_engine_kwargs(
                cfg.model,
                connector=False,
                kv_cache_bytes=parse_size(cfg.kv_cache, "--kv-cache"),
                dtype=cfg.dtype,
                max_model_len=cfg.max_model_len,
            )
            self.server = start_vllm_server(kwargs, self.work / "vllm.log", timeout=600)
        url = self.server.url
        return Served(url, _model_id(url), None, {"server": self.server.process.pid})

    def __exit__(self, *_: object) -> None:
        if self.server is not None:
            self.server.stop()


class _kmesh_server:
    """A store and `kmesh serve --engine E --store S`, stopped on exit."""

    def __init__(self, cfg: AgentsBenchConfig, work: Path) -> None:
        self.cfg, self.work = cfg, work
        self.store: StoreProcess | None = None
        self.server: ServerProcess | None = None

    def __enter__(self) -> Served:
        cfg = self.cfg
        self.store = start_store(self.work, cfg.store_capacity)
        self.server = start_kmesh_serve(
            cfg.engine, self.work / "kmesh.log", kmesh_serve_options(cfg, self.store.socket), 600
        )
        url = self.server.url
        processes = {"server": self.server.process.pid, "store": self.store.process.pid}
        return Served(url, _model_id(url), self.store.socket, processes)

    def __exit__(self, *_: object) -> None:
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            if self.store is not None:
                self.store.stop()


def kmesh_serve_options(cfg: AgentsBenchConfig, store: str) -> tuple[str, ...]:
    """`kmesh serve`'s options for the KMesh strategies: the store, and the vLLM settings the
    plain server gets too."""
    options = ["--store", store]
    if cfg.max_model_len is not None:
        options += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.engine == "vllm":
        options += ["--kv-cache", cfg.kv_cache, "--dtype", cfg.dtype]
    if cfg.model is not None:
        options += ["--model", cfg.model]
    return tuple(options)


def _model_id(url: str) -> str:
    [model] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return str(model["id"])


def _run(
    served: Served, strategy: str, cfg: AgentsBenchConfig, n: int, tokenizer: Any, nonce: str
) -> dict[str, Any]:
    """`n` agents' rounds under `strategy`, closed loop: per round its figures, and its calls."""
    chats = AgentChats(cfg.chats(n), lambda text: tokenizer(text)["input_ids"])
    names = RunNames(strategy, f"{cfg.workload}-{n}-{cfg.seed}-{nonce}", n, cfg.rounds)
    rounds, calls_by_round = [], []
    seen: set[tuple[int, ...]] = set()
    for r in range(cfg.rounds):
        calls = chats.calls()
        bodies = [request_body(strategy, c, r, names, cfg, served.model_id) for c in calls]
        figures = asyncio.run(_round(served, calls, bodies))
        fresh = set().union(*(_segments(c, tokenizer) for c in calls)) - seen
        seen |= fresh
        figures["new_tokens"] = sum(len(tokens) for tokens in fresh)
        rounds.append(figures)
        calls_by_round.append(calls)
        chats.answer(figures["texts"])
    return {"rounds": rounds, "calls": calls_by_round}


async def _round(
    served: Served, calls: list[AgentCall], bodies: list[dict[str, Any]]
) -> dict[str, Any]:
    """One round: every call sent at its delay, all at once; the server sampled meanwhile."""
    before = server_counters(served.url)
    cpu_before = cpu_seconds(served.processes)
    peak = [before["kv_usage"]]
    limits = httpx.Limits(max_connections=len(calls) + 4)
    async with httpx.AsyncClient(
        base_url=served.url, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:

        async def call(delay: float, body: dict[str, Any]) -> CallResult:
            await asyncio.sleep(delay)
            return await send_chat(client, body)

        async def sample() -> None:
            while True:
                await asyncio.sleep(SAMPLE_S)
                reading = await asyncio.to_thread(server_counters, served.url)
                peak.append(reading["kv_usage"])

        sampler = asyncio.create_task(sample())
        try:
            results = await asyncio.gather(
                *(call(c.delay_s, b) for c, b in zip(calls, bodies, strict=True))
            )
        finally:
            sampler.cancel()
    after = server_counters(served.url)
    cpu = cpu_used(cpu_before, cpu_seconds(served.processes))
    store_bytes = None
    if served.store is not None:
        with StoreClient(served.store) as store:
            store_bytes = store.stats()["used"]
    done = list(zip(calls, results, strict=True))
    return {
        "makespan_s": max(r.done_at for r in results) - min(r.sent_at for r in results),
        "ttft_s": [r.total_s if r.first_token_s is None else r.first_token_s for r in results],
        "failures": [f"{c.agent}: {r.failure}" for c, r in done if r.failure],
        "counters": {k: after[k] - before.get(k, 0.0) for k in after if k != "kv_usage"},
        "kv_usage_end": after["kv_usage"],
        "kv_usage_peak": max(peak),
        "store_bytes": store_bytes,
        "cpu_s": cpu,
        "texts": {c.agent: r.text for c, r in done},
    }


def _serial_check(
    served: Served, strategy: str, cfg: AgentsBenchConfig, run: dict[str, Any], nonce: str
) -> dict[str, Any]:
    """`strategy`'s calls of `run` sent again one at a time, under a fresh salt (and families):
    the calls whose text differs from the concurrent run's."""
    n = max(len(calls) for calls in run["calls"])
    names = RunNames(strategy, f"serial-{uuid.uuid4().hex[:8]}-{nonce}", n, cfg.rounds)
    different = []
    checked = 0

    async def one(body: dict[str, Any]) -> CallResult:
        async with httpx.AsyncClient(base_url=served.url, timeout=REQUEST_TIMEOUT_S) as client:
            return await send_chat(client, body)

    for r, (calls, figures) in enumerate(zip(run["calls"], run["rounds"], strict=True)):
        for call in calls:
            body = request_body(strategy, call, r, names, cfg, served.model_id)
            result = asyncio.run(one(body))
            checked += 1
            if result.failure or result.text != figures["texts"][call.agent]:
                different.append({"round": r, "agent": call.agent, "serial": result.text})
    return {"calls": checked, "different": different}


def _segments(call: AgentCall, tokenizer: Any) -> set[tuple[int, ...]]:
    """The call's message segments' token ids, as kmesh serve tokenizes chat messages
    (kmesh/state/chat_codec.py), the generation prompt last."""
    messages = [{"role": m.role, "content": m.content} for m in call.messages]
    prompt = chat_codec.decode(
        messages,
        lambda plain, generation: str(
            tokenizer.apply_chat_template(plain, add_generation_prompt=generation, tokenize=False)
        ),
        lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
    )
    return {s.token_ids for s in prompt.segments}
