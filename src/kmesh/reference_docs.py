"""The generated parts of the reference pages (docs/reference/*.md), rendered from the code.

A page is hand-written prose around generated blocks, each between two markers:

    <!-- generated: serve-flags -->
    ...
    <!-- end generated -->

The block's name says what fills it (BLOCKS): the `kmesh` command line's argparse parsers, the
pydantic models of the request and response objects (each field's type, default, constraints
and `description`), or the Prometheus metrics of kmesh serve and KMeshConnector.
`python -m kmesh.reference_docs` rewrites every block of every page; `--check` only names the
pages that are out of date (exit status 1). tests/test_reference_docs.py fails on a committed
page that differs from what this module renders, so a flag, field or metric added without
regenerating the pages fails the tests.

Why a module run with `python -m` and not a `kmesh docs` command: it writes the repository's
docs folder, so it is a tool for a checkout of KMesh, not for users of the installed package;
as a command it would also list itself among the user commands it documents (docs/reference/
cli.md).

NOTE: argparse has no public way to list a parser's options or sub-commands; this module reads
its `_actions`, `_action_groups` and `_choices_actions`, stable since Python 3.2.
"""

import argparse
import json
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kmesh.serve import schema
from kmesh.serve.request_fields import UNSUPPORTED_SAMPLING
from kmesh.state import request_meta, response_meta

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "docs" / "reference"
REGENERATE = "python -m kmesh.reference_docs"
_BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}


# -- pydantic models -> field tables ------------------------------------------------------


def field_table(model: type[BaseModel], links: dict[type, str], *, own_only: bool = False) -> str:
    """A markdown table of `model`'s fields: name, JSON type and constraints, default, and the
    field's description (required: a field without one is an error). `links`: the anchor of
    each nested model's own table. `own_only`: the fields `model` declares itself, not those it
    inherits."""
    names = list(model.__annotations__) if own_only else list(model.model_fields)
    rows = ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for name in names:
        info = model.model_fields[name]
        if not info.description:
            raise ValueError(f"{model.__name__}.{name} has no description: add description=")
        kind = _json_type(info.annotation, links)
        bounds = _bounds(info)
        if bounds:
            kind += f", {bounds}"
        rows.append(f"| `{name}` | {kind} | {_default(info)} | {_md(info.description)} |")
    return "\n".join(rows) + "\n"


def response_table(model: type[BaseModel], links: dict[type, str]) -> str:
    """A markdown table of a response object's fields: name, JSON type and description."""
    rows = ["| Field | Type | Description |", "| --- | --- | --- |"]
    for name, info in model.model_fields.items():
        if not info.description:
            raise ValueError(f"{model.__name__}.{name} has no description: add description=")
        kind = _json_type(info.annotation, links)
        rows.append(f"| `{name}` | {kind} | {_md(info.description)} |")
    return "\n".join(rows) + "\n"


def _json_type(annotation: Any, links: dict[type, str]) -> str:
    """How a field's annotation reads in JSON terms; `| None` is left out (the default says)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        kinds = [_json_type(a, links) for a in args if a is not type(None)]
        return " or ".join(kinds)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin is list:
        return f"array of {_json_type(args[0], links)}" if args else "array"
    if origin is dict or annotation is dict:
        return "object"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation not in links:
            raise ValueError(f"no anchor for {annotation.__name__}: add it to the block's links")
        return f"[object]({links[annotation]})"
    if annotation in _JSON_TYPES:
        return _JSON_TYPES[annotation]
    raise ValueError(f"no JSON name for the annotation {annotation!r}")


def _bounds(info: FieldInfo) -> str:
    """The field's numeric bounds or length limits, in words."""
    low = high = ""
    shortest = longest = None
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            low = f"[{_number(item.ge)}"
        elif isinstance(item, annotated_types.Gt):
            low = f"({_number(item.gt)}"
        elif isinstance(item, annotated_types.Le):
            high = f"{_number(item.le)}]"
        elif isinstance(item, annotated_types.Lt):
            high = f"{_number(item.lt)})"
        elif isinstance(item, annotated_types.MinLen):
            shortest = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            longest = item.max_length
    if low and high:
        return f"in {low}, {high}"
    if low:
        return ("≥ " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("≤ " if high[-1] == "]" else "< ") + high[:-1]
    unit = "characters" if _without_none(info.annotation) is str else "items"
    if shortest is not None and longest is not None:
        return f"{shortest} to {longest} {unit}"
    if shortest is not None:
        return f"at least {shortest} {unit if shortest > 1 else unit[:-1]}"
    if longest is not None:
        return f"at most {longest} {unit}"
    return ""


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _without_none(annotation: Any) -> Any:
    """`X` of `X | None`; the annotation itself otherwise."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default is None:
        return "—"
    return f"`{json.dumps(info.default)}`"


def unsupported_fields_table() -> str:
    """The OpenAI and vLLM sampling fields kmesh serve does not implement: the values it
    accepts (they change nothing); any other value is refused."""
    rows = ["| Field | Accepted values |", "| --- | --- |"]
    for name, neutral in UNSUPPORTED_SAMPLING.items():
        accepted = ", ".join(f"`{json.dumps(v)}`" for v in neutral) or "none"
        rows.append(f"| `{name}` | {accepted} (or absent) |")
    return "\n".join(rows) + "\n"


# -- argparse parsers -> option tables ----------------------------------------------------


def options_table(actions: list[argparse.Action]) -> str:
    """A markdown table of parser options: flag, value, default and help."""
    rows = ["| Option | Value | Default | Description |", "| --- | --- | --- | --- |"]
    for action in actions:
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
        rows.append(f"| {flags} | {_value(action)} | {_flag_default(action)} | {_help(action)} |")
    return "\n".join(rows) + "\n"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "—"
    if action.choices is not None:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    if action.metavar is not None:
        return f"`{action.metavar}`"
    kind = getattr(action.type, "__name__", "str")
    return {"int": "integer", "float": "number"}.get(kind, "text")


def _flag_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:
        return "off" if not action.default else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "—"
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion (%(default)s, %%)
        text = text % {**vars(action), "prog": ""}
    return _md(text) if text else "—"


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    ]


def grouped_options(parser: argparse.ArgumentParser) -> str:
    """The parser's options as one table per argument group, each under its title (level 3)."""
    parts = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in _options(parser)]
        if not actions:
            continue
        title = group.title or "Options"
        parts.append(f"### {title[0].upper()}{title[1:]}\n\n")
        if group.description:
            parts.append(f"{_md(group.description)}\n\n")
        parts.append(options_table(actions) + "\n")
    return "".join(parts).rstrip("\n") + "\n"


def commands(
    parser: argparse.ArgumentParser, prefix: str = "kmesh"
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(command line, one-line purpose, parser) of every sub-command, depth first."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        purposes = {a.dest: a.help or "" for a in action._choices_actions}
        for name, sub in action.choices.items():
            line = f"{prefix} {name}"
            yield line, purposes.get(name, ""), sub
            yield from commands(sub, line)


def cli_summary(parser: argparse.ArgumentParser) -> str:
    """A table of every command that runs something (not a mere group), with its purpose."""
    rows = ["| Command | Purpose |", "| --- | --- |"]
    for line, purpose, sub in commands(parser):
        if not _groups_only(sub):
            rows.append(f"| [`{line}`](#{_anchor(line)}) | {_md(purpose)} |")
    return "\n".join(rows) + "\n"


def cli_commands(parser: argparse.ArgumentParser, pages: dict[str, str]) -> str:
    """Every command that runs something: a level-3 heading, its purpose, and its options
    (`pages`: commands whose options have a page of their own, linked instead)."""
    parts = []
    for line, purpose, sub in commands(parser):
        if _groups_only(sub):
            continue
        parts.append(f"### {line}\n\n{_md(_sentence(purpose))}\n\n")
        if line in pages:
            parts.append(f"Its options: [{pages[line]}]({pages[line]}).\n\n")
        elif _options(sub):
            parts.append(options_table(_options(sub)) + "\n")
        else:
            parts.append("No options.\n\n")
    return "".join(parts).rstrip("\n") + "\n"


def _groups_only(parser: argparse.ArgumentParser) -> bool:
    """A command group: sub-commands and no options of its own."""
    has_subcommands = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    return has_subcommands and not _options(parser)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def _sentence(text: str) -> str:
    text = text.strip()
    return f"{text[:1].upper()}{text[1:]}." if text and not text.endswith(".") else text


def _md(text: str) -> str:
    """Text for a table cell: pipes escaped, and outside code spans `<` and `*` too (markdown
    would read them as HTML and emphasis)."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


# -- metrics ------------------------------------------------------------------------------


def serve_metrics_table() -> str:
    """The series of kmesh serve's GET /metrics, read from its registry after one served and
    one refused request (so every label appears)."""
    rows = ["| Metric | Type | Labels | Description |", "| --- | --- | --- | --- |"]
    for name, kind, labels, text in _serve_metrics():
        rows.append(f"| `{name}` | {kind} | {labels} | {_md(text)} |")
    return "\n".join(rows) + "\n"


def connector_metrics_table() -> str:
    """The counters KMeshConnector adds to a vLLM server's /metrics: kmesh serve's request
    counters (kmesh/stats.py), with vLLM's `model_name` and `engine` labels first."""
    from kmesh.stats import COUNTERS

    rows = ["| Metric | Type | Labels | Description |", "| --- | --- | --- | --- |"]
    for name, kind, labels, text in _serve_metrics():
        if kind == "counter" and name.removesuffix("_total") in COUNTERS:
            own = "" if labels == "—" else f", {labels}"
            rows.append(f"| `{name}` | counter | `model_name`, `engine`{own} | {_md(text)} |")
    return "\n".join(rows) + "\n"


def _serve_metrics() -> list[tuple[str, str, str, str]]:
    """(exposed name, type, labels, help) of each metric family of kmesh serve."""
    from kmesh.serve.metrics import ServeMetrics
    from kmesh.stats import EngineLoad

    idle = EngineLoad(running=0, waiting=0, kv_usage=0.0, computed_tokens=0)
    metrics = ServeMetrics(lambda: idle)
    metrics.served("/v1/completions", {"prompt_tokens": 1, "recovery": {}}, 0.0)
    metrics.refused("/v1/completions", 400)
    found = []
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = [label for s in family.samples for label in s.labels if label != "le"]
        described = []
        for label in dict.fromkeys(labels):
            if label == "kind":
                kinds = [s.labels["kind"] for s in family.samples if s.name == name]
                described.append(f"`kind` ({', '.join(dict.fromkeys(kinds))})")
            else:
                described.append(f"`{label}`")
        found.append((name, family.type, ", ".join(described) or "—", family.documentation))
    return found


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


# -- pages --------------------------------------------------------------------------------

_REQUEST_LINKS: dict[type, str] = {
    request_meta.SegmentSpec: "#segment",
    request_meta.MessageSpec: "#message",
    request_meta.RecoverySpec: "#recovery",
    request_meta.RoundSpec: "#round",
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
    "recovery": lambda: field_table(request_meta.RecoverySpec, _REQUEST_LINKS),
    "round": lambda: field_table(request_meta.RoundSpec, _REQUEST_LINKS),
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

    return _BLOCK.sub(fill, page)


def stale_pages(folder: Path = REFERENCE_DIR) -> list[Path]:
    """The pages whose generated blocks differ from what the code renders now."""
    return [p for p in sorted(folder.glob("*.md")) if render(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=REGENERATE, description="Regenerate the tables of docs/reference from the code."
    )
    parser.add_argument(
        "--check", action="store_true", help="only name the stale pages (exit status 1 if any)"
    )
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page in stale:
        if args.check:
            print(f"{page}: out of date: run {REGENERATE}", file=sys.stderr)
        else:
            page.write_text(render(page.read_text()))
            print(f"regenerated {page}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
