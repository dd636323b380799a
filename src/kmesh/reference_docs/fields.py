"""Pydantic models -> markdown tables of their fields (the request and response objects)."""

import json
import types
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kmesh.reference_docs.markdown import cell
from kmesh.serve.request_fields import UNSUPPORTED_SAMPLING

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}


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
        rows.append(f"| `{name}` | {kind} | {_default(info)} | {cell(info.description)} |")
    return "\n".join(rows) + "\n"


def response_table(model: type[BaseModel], links: dict[type, str]) -> str:
    """A markdown table of a response object's fields: name, JSON type and description."""
    rows = ["| Field | Type | Description |", "| --- | --- | --- |"]
    for name, info in model.model_fields.items():
        if not info.description:
            raise ValueError(f"{model.__name__}.{name} has no description: add description=")
        kind = _json_type(info.annotation, links)
        rows.append(f"| `{name}` | {kind} | {cell(info.description)} |")
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
