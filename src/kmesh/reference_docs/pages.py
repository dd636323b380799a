"""The reference pages (docs/reference/*.md) and the blocks generated in them.

A generated block sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; BLOCKS
names what renders each one. `render` fills every block of a page; `stale_pages` lists the pages
whose blocks differ from what the code renders now.
"""

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from kmesh.reference_docs.fields import field_table, response_table, unsupported_fields_table
from kmesh.reference_docs.metrics import connector_metrics_table, serve_metrics_table
from kmesh.reference_docs.options import cli_commands, cli_summary, commands, grouped_options
from kmesh.serve import schema
from kmesh.state import recovery_meta, request_meta, response_meta

REFERENCE_DIR = Path(__file__).resolve().parents[3] / "docs" / "reference"
REGENERATE = "python -m kmesh.reference_docs"
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)


def store_stats_fields() -> str:
    """The fields of the store's `stats` answer (kmesh/store/protocol.py::StatsInfo)."""
    import msgspec

    from kmesh.store.protocol import StatsInfo

    names = [f.name for f in msgspec.structs.fields(StatsInfo) if f.name != "v"]
    return ", ".join(f"`{name}`" for name in names) + "\n"


def allocator_env_table() -> str:
    """The glibc allocator settings of vLLM's processes (kmesh/vllm/config.py)."""
    from kmesh.vllm.config import ALLOCATOR_ENV

    rows = ["| Variable | Value |", "| --- | --- |"]
    for name, value in ALLOCATOR_ENV.items():
        rows.append(f"| `{name}` | `{value}`{_in_units(int(value))} |")
    return "\n".join(rows) + "\n"


def _in_units(nbytes: int) -> str:
    """` (32 MiB)` for a whole number of MiB or GiB; empty otherwise."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= size and nbytes % size == 0:
            return f" ({nbytes // size} {unit})"
    return ""


_REQUEST_LINKS: dict[type, str] = {
    request_meta.SegmentSpec: "#segment",
    request_meta.MessageSpec: "#message",
    recovery_meta.RecoverySpec: "#recovery",
    recovery_meta.RoundSpec: "#round",
    schema.StreamOptions: "#stream_options",
    schema.ChatMessage: "#chat-message",
    schema.TextPart: "#chat-message",
}
_RESPONSE_LINKS: dict[type, str] = {
    response_meta.RecoveryStats: "#recovery",
    response_meta.QualityStats: "#quality",
    response_meta.ActivationStats: "#activation",
}


def _cli_parser() -> argparse.ArgumentParser:
    from kmesh.cli import build_parser

    return build_parser()


def _serve_parser() -> argparse.ArgumentParser:
    return next(sub for line, _, sub in commands(_cli_parser()) if line == "kmesh serve")


BLOCKS: dict[str, Callable[[], str]] = {
    "kmesh-object": lambda: field_table(request_meta.KMeshParams, _REQUEST_LINKS),
    "segment": lambda: field_table(request_meta.SegmentSpec, _REQUEST_LINKS),
    "message": lambda: field_table(request_meta.MessageSpec, _REQUEST_LINKS),
    "recovery": lambda: field_table(recovery_meta.RecoverySpec, _REQUEST_LINKS),
    "round": lambda: field_table(recovery_meta.RoundSpec, _REQUEST_LINKS),
    "generation-fields": lambda: field_table(schema.GenerationRequest, _REQUEST_LINKS),
    "completion-fields": lambda: field_table(
        schema.CompletionRequest, _REQUEST_LINKS, own_only=True
    ),
    "chat-fields": lambda: field_table(schema.ChatCompletionRequest, _REQUEST_LINKS, own_only=True),
    "chat-message": lambda: field_table(schema.ChatMessage, _REQUEST_LINKS),
    "stream-options": lambda: field_table(schema.StreamOptions, _REQUEST_LINKS),
    "unsupported-fields": unsupported_fields_table,
    "response-kmesh": lambda: response_table(response_meta.KMeshStats, _RESPONSE_LINKS),
    "response-recovery": lambda: response_table(response_meta.RecoveryStats, _RESPONSE_LINKS),
    "response-quality": lambda: response_table(response_meta.QualityStats, _RESPONSE_LINKS),
    "response-activation": lambda: response_table(response_meta.ActivationStats, _RESPONSE_LINKS),
    "serve-flags": lambda: grouped_options(_serve_parser()),
    "cli-summary": lambda: cli_summary(_cli_parser()),
    "cli-commands": lambda: cli_commands(_cli_parser(), {"kmesh serve": "serve.md"}),
    "serve-metrics": serve_metrics_table,
    "connector-metrics": connector_metrics_table,
    "allocator-env": allocator_env_table,
    "store-stats": store_stats_fields,
}


def render(page: str) -> str:
    """`page` with every generated block filled from the code."""

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        return f"{match[1]}\n{BLOCKS[name]()}\n{match[4]}"

    return BLOCK.sub(fill, page)


def stale_pages(folder: Path = REFERENCE_DIR) -> list[Path]:
    """The pages whose generated blocks differ from what the code renders now."""
    return [p for p in sorted(folder.glob("*.md")) if render(p.read_text()) != p.read_text()]
