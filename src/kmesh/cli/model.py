"""`kmesh model info`: the model's config and where it is cached."""

import argparse
import json
from dataclasses import asdict

from kmesh.cli.common import Commands, add_model_option


def _model_info(args: argparse.Namespace) -> None:
    from kmesh.compute.embedded import cache_dir
    from kmesh.compute.loader import load_model

    model = load_model(args.model)
    config = asdict(model.config)
    info = {
        "path": str(model.path),
        "cache_dir": str(cache_dir()),
        "fingerprint": model.fingerprint,
        "dtype": str(model.executor.dtype).removeprefix("torch."),
        "has_chat_template": bool(getattr(model.tokenizer, "chat_template", None)),
    }
    if args.json:
        print(json.dumps({**info, "config": config}))
        return
    for key, value in info.items():
        print(f"{key:18} {value}")
    print("config")
    for key, value in config.items():
        print(f"  {key:20} {value}")


def register(commands: Commands) -> None:
    model = commands.add_parser("model", help="the model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    info = model_commands.add_parser("info", help="print the model's config and cache location")
    add_model_option(info)
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_model_info)
