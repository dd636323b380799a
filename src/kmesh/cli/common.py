"""What the command modules share: the --model and --store options and the store socket check
(what only the bench commands share: cli/bench_common.py)."""

import argparse
from pathlib import Path
from typing import Any

from kmesh.errors import InvalidRequestError

# What `add_subparsers()` returns, where each command module registers its parsers (argparse's
# class for it is private).
Commands = Any
# A parser or one of its argument groups (argparse's common base class is private).
Options = argparse._ActionsContainer


def add_model_option(parser: Options, context: bool = False) -> None:
    """--model: a model folder; the embedded model when absent. With `context`, for a command
    that starts an engine, --max-model-len too (kmesh/compute/context.py)."""
    parser.add_argument(
        "--model",
        default=None,
        help="a packaged model's name (SmolLM2-135M-Instruct, gemma-3-270m) or a model folder "
        "(default: the embedded model)",
    )
    if context:
        parser.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            metavar="TOKENS",
            help="the engine's context, prompt and output together (default: the model's, "
            "bounded by what the KV cache holds; the start line says which)",
        )


def add_store_option(parser: Options) -> None:
    """--store: a store's socket, checked by `check_store`."""
    parser.add_argument(
        "--store", default=None, help="a `kmesh store serve` socket: restore from it, publish to it"
    )


def check_store(store: str | None) -> None:
    """Refuse a --store socket path where no store listens."""
    if store is not None and not Path(store).exists():
        raise InvalidRequestError(
            f"no store socket at {store!r}: start one with `kmesh store serve --socket PATH`"
        )


def check_model(model: str | None, engine: str, max_model_len: int | None = None) -> None:
    """What `kmesh model info` states, checked against the engine a command will start, before
    it starts: a model KMesh cannot run there, or a `max_model_len` longer than the model's
    context, raises KMeshError in one line (the command exits 2). `engine`: "vllm" (with
    KMeshConnector), "vllm-vanilla" or "reference". Whether the command's own KV cache holds
    the context is checked where it builds the engine, with its sizes."""
    from kmesh.compute.config import ModelConfig
    from kmesh.compute.context import resolve_context
    from kmesh.compute.loader import resolve_model_dir

    config = ModelConfig.from_folder(resolve_model_dir(model))
    if engine.startswith("vllm"):
        from kmesh.vllm.config import vllm_engine_kwargs

        vllm_engine_kwargs(model, connector=engine == "vllm")
    if max_model_len is not None:
        resolve_context(config, max_model_len, max_model_len)
