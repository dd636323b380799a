"""`kmesh model info`: the model's description, what KMesh does with it, and where it is cached.

Reads the folder's config.json only (no weights): a model KMesh cannot run is refused here in the
one line loading it would print (kmesh.errors.ModelNotSupportedError).
"""

import argparse
import json
from dataclasses import asdict
from itertools import groupby
from typing import Any

from kmesh.cli.common import Commands, add_model_option


def describe(config: Any) -> dict[str, Any]:
    """The description as JSON: model-wide fields, then the layers as runs of equal layers
    (`first`, `count`, `window`, the RoPE table)."""
    fields = {k: v for k, v in asdict(config).items() if k != "layers"}
    runs = []
    for (window, rope), group in groupby(
        enumerate(config.layers), key=lambda item: (item[1].window, item[1].rope)
    ):
        members = [index for index, _ in group]
        runs.append(
            {
                "first": members[0],
                "count": len(members),
                "window": window,
                "rope": {
                    "scaling": rope.scaling,
                    "theta": rope.theta,
                    "attention_factor": rope.attention_factor,
                },
            }
        )
    return {**fields, "layers": runs}


def _model_info(args: argparse.Namespace) -> None:
    from kmesh.compute.config import ModelConfig
    from kmesh.compute.embedded import cache_dir
    from kmesh.compute.fingerprint import model_fingerprint
    from kmesh.compute.loader import load_tokenizer, resolve_model_dir
    from kmesh.compute.support import support_table

    path = resolve_model_dir(args.model)
    config = ModelConfig.from_folder(path)
    info = {
        "path": str(path),
        "cache_dir": str(cache_dir()),
        "fingerprint": model_fingerprint(path),
        "has_chat_template": bool(getattr(load_tokenizer(path), "chat_template", None)),
    }
    table = [
        {"mechanism": s.mechanism, "status": s.status, "tested": s.tested, "why": s.why}
        for s in support_table(config)
    ]
    description = describe(config)
    if args.json:
        print(json.dumps({**info, "config": description, "support": table}))
        return
    for key, value in info.items():
        print(f"{key:18} {value}")
    print("model")
    for key, value in description.items():
        if key != "layers":
            print(f"  {key:20} {value}")
    print("layers")
    for run in description["layers"]:
        last = run["first"] + run["count"] - 1
        window = "global" if run["window"] is None else f"window {run['window']}"
        rope = run["rope"]
        print(
            f"  {run['first']:>3}-{last:<3} {window:12} RoPE {rope['scaling']} "
            f"theta {rope['theta']:g}"
            + (f" x{rope['attention_factor']:.4g}" if rope["attention_factor"] != 1.0 else "")
        )
    print("support")
    for entry in support_table(config):
        print(f"  {entry.mechanism:26} {entry.label:14} {entry.why}")


def register(commands: Commands) -> None:
    model = commands.add_parser("model", help="the model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    info = model_commands.add_parser(
        "info",
        help="print the model's description, what KMesh does with it, and its cache location",
    )
    add_model_option(info)
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_model_info)
