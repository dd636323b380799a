"""`kmesh bench load`: `kmesh serve` under many concurrent clients, faults and hostile bodies.

On loopback only, bounded in time and count. The bench starts a store (`kmesh store serve`) and
`kmesh serve --engine E --store S --api-keys K` (two tenants), or for `vllm-vanilla` vLLM's own
OpenAI server (no connector, one API key; the plain mix only: the side-by-side reference for
vLLM's own memory), then:

1. soak: N client tasks send the mix of workloads/serve_traffic.py until `seconds` have passed; each
   exchange is timed (first token: the first content chunk of a stream, or the whole answer) and
   judged against its expectation. Every `sample_s` the server's RSS (its process and children:
   vLLM's engine core) and the store's bytes are sampled.
2. cold check: up to `check` of the exact exchanges, drawn at random, are sent again one at a time
   under a fresh cache_salt (nothing to reuse: a cold engine's answer) and their texts compared.
3. abandon (`abandon` > 0): that many families and rounds (every tenth a round: a round's
   recovery costs about five families here) are opened, one member of several declared, never
   closed; 32 at a time, RSS sampled every `abandon // 20`.

Failures by kind: http_5xx, unexpected_status (a valid request refused, a bad body accepted),
transport (connection errors, timeouts), bad_stream (a stream without its [DONE]).
"""

import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from kmesh.bench.common import quantile
from kmesh.bench.load.client import ExchangeResult, send_exchange
from kmesh.bench.process_tree import rss_mib
from kmesh.errors import InvalidRequestError
from kmesh.serve.process import start_kmesh_serve, start_vllm_server
from kmesh.store.client import StoreClient
from kmesh.store.process import start_store
from kmesh.vllm.config import vllm_engine_kwargs
from kmesh.workloads.serve_traffic import KINDS, PLAIN_KINDS, Exchange, next_exchange, round_member

KEY_A, KEY_B = "kmesh-load-key-a", "kmesh-load-key-b"
VANILLA = "vllm-vanilla"
MIXES = ("full", "plain")
TENANT_KEYS = {KEY_A: "load-a", KEY_B: "load-b"}
REQUEST_TIMEOUT_S = 300
ABANDON_CLIENTS = 32


@dataclass(frozen=True, slots=True)
class LoadConfig:
    engine: str  # reference, vllm, or vllm-vanilla (vLLM's own server, the plain mix only)
    clients: int
    seconds: float
    check: int = 60
    abandon: int = 0
    seed: int = 0
    mix: str = "full"  # full: every kind; plain: what any OpenAI server takes (PLAIN_KINDS)
    sample_s: float = 5.0
    store_capacity: str = "256M"
    # kmesh serve --recovery-bytes: small enough that recovery's cache is full after warm-up,
    # so that the RSS slope shows leaks, not a cache filling to its budget.
    recovery_bytes: str = "128M"

    def __post_init__(self) -> None:
        if self.clients < 1 or self.seconds <= 0:
            raise InvalidRequestError("--clients must be at least 1 and --seconds above 0")
        if self.check < 0 or self.abandon < 0:
            raise InvalidRequestError("--check and --abandon must be 0 or more")
        if self.mix not in MIXES:
            raise InvalidRequestError(f"--mix must be one of {', '.join(MIXES)}")
        if self.engine == VANILLA and (self.mix != "plain" or self.abandon):
            raise InvalidRequestError(
                f"--engine {VANILLA} is vLLM's own server: it takes --mix plain and no --abandon "
                "(families, rounds and tenants are KMesh's)"
            )

    @property
    def kinds(self) -> tuple[str, ...]:
        return PLAIN_KINDS if self.mix == "plain" else tuple(KINDS)

    @property
    def keys(self) -> tuple[str, ...]:
        """The API keys clients send: both tenants', or one with the plain mix (vanilla vLLM
        knows one key)."""
        return (KEY_A,) if self.mix == "plain" else (KEY_A, KEY_B)


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per minute (0 with fewer than 2)."""
    if len(samples) < 2:
        return 0.0
    xs, ys = [t for t, _ in samples], [v for _, v in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return (
        0.0
        if var == 0
        else 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    )


async def _soak(cfg: LoadConfig, url: str, pid: int, store: str | None, log: Any) -> dict[str, Any]:
    deadline = time.monotonic() + cfg.seconds
    outcomes: list[tuple[Exchange, ExchangeResult]] = []
    samples: list[dict[str, Any]] = []
    serial = iter(range(10**9))
    limits = httpx.Limits(max_connections=cfg.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker(index: int) -> None:
            rng = random.Random(cfg.seed * 1000 + index)
            while time.monotonic() < deadline:
                exchange = next_exchange(rng, cfg.keys, next(serial), cfg.kinds)
                outcomes.append((exchange, await send_exchange(client, exchange)))

        async def sampler() -> None:
            started = time.monotonic()
            while time.monotonic() < deadline:
                samples.append(_sample(started, pid, store))
                last = samples[-1]
                log(f"load: {last['t']:.0f}s, {len(outcomes)} requests, {last['rss_mib']:.0f} MiB")
                await asyncio.sleep(cfg.sample_s)
            samples.append(_sample(started, pid, store))

        await asyncio.gather(sampler(), *(worker(i) for i in range(cfg.clients)))
    return {"outcomes": outcomes, "samples": samples}


def _sample(started: float, pid: int, store: str | None) -> dict[str, Any]:
    used = 0
    if store is not None:
        with StoreClient(store) as client:
            used = client.stats()["used"]
    rss = rss_mib(pid)
    return {
        "t": time.monotonic() - started,
        "rss_mib": rss.pop("total"),
        "store_mib": used / 2**20,
        "rss_by_process_mib": rss,
    }


async def _cold_check(
    cfg: LoadConfig, url: str, outcomes: list[tuple[Exchange, ExchangeResult]]
) -> dict[str, Any]:
    """The exact exchanges' texts against a cold run of the same body (a fresh salt)."""
    served = [(e, o) for e, o in outcomes if e.exact and o.status == 200 and o.text is not None]
    rng = random.Random(cfg.seed)
    chosen = rng.sample(served, min(cfg.check, len(served)))
    wrong = []
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        for exchange, outcome in chosen:
            body = {**exchange.body, "cache_salt": f"cold-{uuid.uuid4().hex}"}
            kmesh = body.get("kmesh")
            if kmesh is not None and "family" in kmesh:  # a family of its own, not the soak's
                body["kmesh"] = {**kmesh, "family": f"cold-{uuid.uuid4().hex}"}
            cold = await send_exchange(
                client, Exchange(exchange.kind, exchange.path, body, exchange.key)
            )
            if cold.text != outcome.text:
                wrong.append({"kind": exchange.kind, "served": outcome.text, "cold": cold.text})
    return {"checked": len(chosen), "wrong": wrong}


async def _abandon(cfg: LoadConfig, url: str, pid: int, log: Any) -> dict[str, Any]:
    """Open `cfg.abandon` families and rounds, one member each, never closed."""
    key = KEY_A
    rng = random.Random(cfg.seed)
    every = max(1, cfg.abandon // 20)
    samples = [{"opened": 0, "rss_mib": rss_mib(pid)["total"]}]
    failures: Counter[str] = Counter()
    opened = iter(range(cfg.abandon))
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:

        async def worker() -> None:
            for i in opened:
                if i % 10 == 9:
                    body = round_member(rng, 10**9 + i)
                else:
                    segments = [
                        {
                            "text": f"Ticket {i}: the crane is broken.",
                            "role": "shared",
                            "id": f"t{i}",
                        },
                        {"text": " Fix:"},
                    ]
                    body = {
                        "prompt": "",
                        "max_tokens": 1,
                        "kmesh": {"family": f"abandoned-{i}", "branches": 4, "segments": segments},
                    }
                outcome = await send_exchange(
                    client, Exchange("abandon", "/v1/completions", body, key)
                )
                if outcome.failure:
                    failures[outcome.failure] += 1
                if (i + 1) % every == 0:
                    samples.append({"opened": i + 1, "rss_mib": rss_mib(pid)["total"]})
                    log(f"abandon: {i + 1} opened, rss {samples[-1]['rss_mib']:.0f} MiB")

        await asyncio.gather(*(worker() for _ in range(ABANDON_CLIENTS)))
    samples.sort(key=lambda s: s["opened"])
    return {"opened": cfg.abandon, "failures": dict(failures), "rss_mib": samples}


def run_load_bench(cfg: LoadConfig, log: Any = print) -> dict[str, Any]:
    """The whole run (module docstring); its report as a JSON-ready dict."""
    with tempfile.TemporaryDirectory(prefix="kml-") as folder:
        directory = Path(folder)
        keys = directory / "keys.json"
        keys.write_text(json.dumps(TENANT_KEYS))
        store = None if cfg.engine == VANILLA else start_store(directory, cfg.store_capacity)
        if store is None:
            kwargs = {**vllm_engine_kwargs(None, connector=False), "api_key": KEY_A}
            server = start_vllm_server(kwargs, directory / "serve.log", timeout=600)
        else:
            options = (
                *("--store", store.socket, "--api-keys", str(keys)),
                *("--recovery-bytes", cfg.recovery_bytes),
            )
            timeout = 600 if cfg.engine == "vllm" else 180
            server = start_kmesh_serve(cfg.engine, directory / "serve.log", options, timeout)
        socket = None if store is None else store.socket
        try:
            log(f"load: {cfg.clients} clients for {cfg.seconds:.0f}s on {server.url}")
            soak = asyncio.run(_soak(cfg, server.url, server.process.pid, socket, log))
            log(f"load: cold check of up to {cfg.check} exact answers")
            check = asyncio.run(_cold_check(cfg, server.url, soak["outcomes"]))
            abandoned = None
            if cfg.abandon:
                abandoned = asyncio.run(_abandon(cfg, server.url, server.process.pid, log))
        finally:
            server_log = server.stop()
            if store is not None:
                store.stop()
    return report(cfg, soak, check, abandoned, server_log)


def report(
    cfg: LoadConfig,
    soak: dict[str, Any],
    check: dict[str, Any],
    abandoned: dict[str, Any] | None,
    server_log: str,
) -> dict[str, Any]:
    outcomes: list[tuple[Exchange, ExchangeResult]] = soak["outcomes"]
    failures = Counter(o.failure.split(":")[0] for _, o in outcomes if o.failure)
    firsts = [
        o.first_token_s for _, o in outcomes if o.first_token_s is not None and o.status == 200
    ]
    totals = [o.total_s for _, o in outcomes if o.status == 200 and o.failure is None]
    samples = soak["samples"]
    warm = [s for s in samples if s["t"] >= min(60.0, cfg.seconds / 4)]
    return {
        "config": asdict(cfg),
        "requests": len(outcomes),
        "by_kind": dict(Counter(e.kind for e, _ in outcomes)),
        "failures": {"http_5xx": failures.pop("http_5xx", 0), **failures},
        "wrong_exact": len(check["wrong"]),
        "checked_exact": check["checked"],
        "wrong_examples": check["wrong"][:5],
        "latency_s": {
            "first_token_p50": quantile(firsts, 0.5),
            "first_token_p99": quantile(firsts, 0.99),
            "total_p50": quantile(totals, 0.5),
            "total_p99": quantile(totals, 0.99),
        },
        "rss_mib": samples,
        "rss_slope_mib_per_min": slope_per_minute([(s["t"], s["rss_mib"]) for s in warm]),
        "store_slope_mib_per_min": slope_per_minute([(s["t"], s["store_mib"]) for s in warm]),
        "abandoned": abandoned,
        "server_tracebacks": server_log.count("Traceback"),
    }
