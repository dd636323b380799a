"""`kmesh bench round`: one All-Gather round's collective recovery against prefilling it, on the
CPU or a GPU (bench/round/run.py)."""

import argparse
from typing import TYPE_CHECKING

from kmesh.bench.round.config import RoundBenchConfig
from kmesh.cli.bench_common import (
    add_bench_options,
    add_config_flag,
    config_from_args,
    emit_report,
    progress,
)
from kmesh.cli.common import Commands
from kmesh.compute.config import DTYPES
from kmesh.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from kmesh.compute.config import ModelConfig


def _device(name: str) -> "torch.device":
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidRequestError(f"--device {name!r} is not a device; give cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda: torch sees no CUDA device here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"--device {name!r}: the executor runs on cpu or cuda")
    return device


def _bench_round(args: argparse.Namespace) -> None:
    import torch

    from kmesh.bench.round.run import print_round, run_round_bench
    from kmesh.compute.config import ModelConfig
    from kmesh.compute.executor import Executor
    from kmesh.compute.loader import load_model
    from kmesh.compute.tiny import SHAPES, random_state_dict
    from kmesh.compute.weights import ModelWeights

    cfg = config_from_args(RoundBenchConfig, args)
    device = _device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.shape is not None and args.model is not None:
        raise InvalidRequestError("give --shape (random weights) or --model, not both")
    if args.shape is not None and args.shape not in SHAPES:
        raise InvalidRequestError(f"--shape takes one of {', '.join(SHAPES)}; got {args.shape!r}")
    log = progress()
    if args.shape is not None:
        hf = SHAPES[args.shape]
        config = ModelConfig.from_hf(hf)
        _check_fits(cfg, config)  # before the weights: an 8B shape takes a while to make
        state = random_state_dict(cfg.seed, hf, config.hidden_size**-0.5, device, dtype)
        executor = Executor(config, ModelWeights.from_state_dict(state, config, dtype))
        model = f"random weights in {args.shape}'s shape"
    else:
        loaded = load_model(args.model, dtype, device)
        executor, model = loaded.executor, loaded.path.name
        _check_fits(cfg, executor.config)
    emit_report(args, run_round_bench(executor, model, cfg, log), print_round)


def _check_fits(cfg: RoundBenchConfig, config: "ModelConfig") -> None:
    if cfg.prompt_tokens > config.max_position:
        raise InvalidRequestError(
            f"a sibling's prompt is {cfg.prompt_tokens} tokens, past the model's "
            f"{config.max_position} positions: lower --trunk-tokens, --siblings or "
            "--segment-tokens"
        )


def register(benches: Commands) -> None:
    parser = benches.add_parser(
        "round", help="one round's collective recovery vs prefilling it, on the CPU or a GPU"
    )
    default = RoundBenchConfig()
    add_config_flag(parser, default, "siblings")
    add_config_flag(parser, default, "segment_tokens", "each sibling's output of the last round")
    add_config_flag(parser, default, "trunk_tokens", "the prefix every sibling shares")
    add_config_flag(parser, default, "ask_tokens")
    add_config_flag(parser, default, "repeats", "timed runs per strategy, after a warm-up")
    add_config_flag(parser, default, "seed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="default float32")
    parser.add_argument(
        "--shape",
        default=None,
        help="random weights in a model's shape instead of --model's: tiny, smollm2_135m or "
        "llama3_8b (compute/tiny.py; llama3_8b takes 16 GB in bfloat16, a GPU's job)",
    )
    add_bench_options(parser, _bench_round)
