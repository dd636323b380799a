"""`kmesh serve`: an OpenAI-compatible HTTP server on the reference engine or vLLM."""

import argparse
import logging
import os
import socket

from kmesh.cli.common import Commands, add_model_option, add_store_option, check_store
from kmesh.compute.config import DTYPES
from kmesh.errors import InvalidRequestError
from kmesh.extras import VLLM, require


def _serve(args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        require(VLLM, "kmesh serve --engine vllm")
    import uvicorn

    from kmesh.serve.app import create_app
    from kmesh.serve.backend import Backend
    from kmesh.serve.body_limit import BodyLimit
    from kmesh.store.server import parse_size

    check_store(args.store)
    reuse_messages = None
    if args.reuse_messages:
        from kmesh.serve.jobs import REUSE_MESSAGES

        reuse_messages = REUSE_MESSAGES
        if args.reuse_ratio is not None and args.quality is not None:
            raise InvalidRequestError("--quality replaces --reuse-ratio: give one of them")
        if args.reuse_ratio is not None:
            if not 0 <= args.reuse_ratio <= 1:
                raise InvalidRequestError(
                    f"--reuse-ratio must be in [0, 1], got {args.reuse_ratio}"
                )
            reuse_messages = REUSE_MESSAGES.model_copy(update={"ratio": args.reuse_ratio})
        if args.quality is not None:
            from kmesh.state.recovery_meta import RecoverySpec, check_quality_target

            target = check_quality_target(args.quality, "--quality")
            reuse_messages = RecoverySpec(quality=target)
    elif args.reuse_ratio is not None or args.quality is not None:
        raise InvalidRequestError("--reuse-ratio and --quality need --reuse-messages")
    api_keys = None
    if args.api_keys is not None:
        from kmesh.state.tenants import load_api_keys

        api_keys = load_api_keys(args.api_keys)
    recovery_bytes = None
    if args.recovery_bytes is not None:
        recovery_bytes = parse_size(args.recovery_bytes, "--recovery-bytes")
    max_body = parse_size(args.max_body, "--max-body")
    kv_cache_bytes = None
    if args.kv_cache is not None:
        kv_cache_bytes = parse_size(args.kv_cache, "--kv-cache")
    heap_reserve_bytes = _vllm_size(
        args, args.heap_reserve, "--heap-reserve", "vLLM's worker's heap reserve", least=0
    )
    if args.dtype is not None and args.engine != "vllm":
        raise InvalidRequestError(
            "--dtype picks vLLM's dtype: it needs --engine vllm (the reference engine computes "
            "in float32)"
        )
    if args.tensor_parallel_size is not None and args.engine != "vllm":
        raise InvalidRequestError(
            "--tensor-parallel-size splits vLLM's workers: it needs --engine vllm"
        )
    listener = _listen(args.host, args.port)
    backend: Backend
    if args.engine == "vllm":
        from kmesh.serve.vllm_backend import VLLMBackend
        from kmesh.vllm.config import DEFAULT_DTYPE

        backend = VLLMBackend(
            args.model,
            store=args.store,
            recovery_bytes=recovery_bytes,
            heap_reserve_bytes=heap_reserve_bytes,
            kv_cache_bytes=kv_cache_bytes,
            dtype=args.dtype or DEFAULT_DTYPE,
            tensor_parallel_size=args.tensor_parallel_size or 1,
            max_model_len=args.max_model_len,
        )
        print(
            f"kmesh serve: starting vLLM, {backend.context.describe()} (about a minute on 2 "
            "cores)...",
            flush=True,
        )
    else:
        from kmesh.serve.reference_backend import ReferenceBackend

        options: dict[str, int] = {}
        if recovery_bytes is not None:
            options["recovery_bytes"] = recovery_bytes
        backend = ReferenceBackend(
            args.model,
            store=args.store,
            max_model_len=args.max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            **options,
        )
        print(f"kmesh serve: reference engine, {backend.context.describe()}", flush=True)
    port = listener.getsockname()[1]

    def ready() -> None:
        print(
            f"kmesh serve: {backend.engine} engine on http://{args.host}:{port} "
            f"(model {backend.model_id})",
            flush=True,
        )

    access = logging.getLogger("kmesh.serve")  # the access lines and ignored fields, on stderr
    access.setLevel(logging.INFO)
    access.addHandler(logging.StreamHandler())
    app = create_app(
        backend,
        on_ready=ready,
        strict_fields=args.strict_fields,
        reuse_messages=reuse_messages,
        api_keys=api_keys,
    )
    config = uvicorn.Config(BodyLimit(app, max_body), log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket (bound before the model loads, so a taken port fails at once)."""
    if not 0 <= port <= 65535:
        raise InvalidRequestError(f"--port must be in 0..65535 (0: any free port), got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise InvalidRequestError(
            f"unknown --host {host!r} ({error.strerror}): give an address like 127.0.0.1"
        ) from None
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise InvalidRequestError(
            f"cannot listen on {host}:{port} ({reason}): pick another --port or --host"
        ) from None


def _vllm_size(
    args: argparse.Namespace, value: str | None, flag: str, what: str, least: int = 1
) -> int | None:
    """A size option only `--engine vllm` takes, in bytes (None when not given)."""
    if value is None:
        return None
    from kmesh.store.server import parse_size

    if args.engine != "vllm":
        raise InvalidRequestError(f"{flag} sizes {what}: it needs --engine vllm")
    return parse_size(value, flag, least=least)


def register(commands: Commands) -> None:
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat) until SIGTERM/SIGINT"
    )
    engine = serve.add_argument_group("engine and model")
    engine.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        required=True,
        help="reference: KMesh's own engine; vllm: vLLM with KMeshConnector",
    )
    add_model_option(engine, context=True)
    engine.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="--engine vllm: the model's and the KV cache's dtype (default float32, the "
        "reference engine's; vLLM's own default on a CPU with bfloat16 is bfloat16)",
    )
    engine.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="--engine vllm: workers, each holding a shard of the heads (default 1; on the CPU "
        "each bound to its share of the cores; recovery runs with 1 only)",
    )
    access = serve.add_argument_group("listening and access")
    access.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    access.add_argument("--port", type=int, default=8000, help="0: any free port")
    access.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help='JSON {"API key": "tenant", ...}: requests need `Authorization: Bearer KEY`, and '
        "state never crosses tenants (default: no keys, one namespace)",
    )
    access.add_argument(
        "--max-body",
        default="16M",
        metavar="SIZE",
        help="the largest request body taken, like 512K or 16M; a larger one is a 413 before it "
        "is read (default: 16M)",
    )
    access.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse request fields the server does not know (default: ignore and log them)",
    )
    reuse = serve.add_argument_group("message reuse (approximate)")
    reuse.add_argument(
        "--reuse-messages",
        action="store_true",
        help="approximate: a chat without a kmesh object, under a cache_salt starting with "
        "kmesh-approx, reuses any message another request of that tenant computed",
    )
    reuse.add_argument(
        "--reuse-ratio",
        type=float,
        default=None,
        help="with --reuse-messages: share of the reused rows recomputed (default 0.3, "
        "per-request recovery's; docs/benchmarks.md has the sweep)",
    )
    reuse.add_argument(
        "--quality",
        default=None,
        help="with --reuse-messages: a quality target in place of --reuse-ratio: exact, greedy "
        "or kl:<x> (a target the server cannot meet is served exactly, and the response's "
        "kmesh.quality says so)",
    )
    memory = serve.add_argument_group("store and memory")
    add_store_option(memory)
    memory.add_argument(
        "--recovery-bytes",
        default=None,
        metavar="SIZE",
        help="what recovery keeps (stored segments, round masters) at most, like 256M "
        "(default 1G; least recently used dropped first)",
    )
    memory.add_argument(
        "--kv-cache",
        default=None,
        metavar="SIZE",
        help="the engine's KV cache, like 2G (default: 1G on vLLM, 16384 tokens' worth on the "
        "reference engine)",
    )
    memory.add_argument(
        "--heap-reserve",
        default=None,
        metavar="SIZE",
        help="--engine vllm: memory the worker writes once at start and keeps for recovery's "
        "buffers, like 1G or 0 for none (default half the KV cache, at most a quarter of the "
        "memory available; docs/reference/connector.md)",
    )
    serve.set_defaults(func=_serve)
