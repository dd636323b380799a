"""The `kmesh` object a request carries: its family and its segments, as a caller writes them.

The same object is accepted by `kmesh serve` (top-level body field `kmesh`, both engines) and by
a plain vLLM server running KMeshConnector (`kv_transfer_params: {"kmesh": {...}}`), e.g.

    {"family": "f1", "branches": 8,
     "segments": [{"text": "...", "role": "shared", "id": "trunk"},
                  {"text": "...", "role": "private"}]}

The segments' concatenation is the prompt (a segment is text, or token ids the caller made). The
leading run of shared segments is the family's trunk: its full blocks stay pinned in the store
while the family is open. A family closes when a request of it carrying `"close": true` finishes,
or when `branches` requests of it have finished on that engine (each engine counts its own), or
when the engine stops.

`recovery` (its models: kmesh/state/recovery_meta.py) asks KMeshConnector to fill the prompt's
blocks after vLLM's local prefix hit itself (kmesh/recovery/requests.py), e.g. an All-Gather
sibling:

    {"family": "council",
     "segments": [..., {"token_ids": [...], "role": "shared", "id": "out-0-3"}, ...],
     "recovery": {"policy": "kv_deviation", "ratio": 0.0, "gate": 0.1,
                  "round": {"id": "r1", "segments": ["out-0-0", ..., "out-0-7"]}}}
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kmesh.errors import ContractError, InvalidRequestError
from kmesh.state.recovery_meta import MAX_NAME_CHARS, RecoverySpec
from kmesh.state.segments import Role, Span
from kmesh.state.separator_codec import split_text

KMESH_PARAMS_KEY = "kmesh"


class SegmentSpec(BaseModel):
    """One segment: its text, or its token ids when the caller tokenized it (exactly one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str | None = Field(
        default=None, min_length=1, description="The segment's text (or give `token_ids`)."
    )
    token_ids: list[int] | None = Field(
        default=None,
        min_length=1,
        description="The segment's token ids, tokenized by the caller (or give `text`).",
    )
    role: Literal["shared", "private", "instruction"] = Field(
        default="private",
        description="`shared`: text other requests also hold (the leading shared segments are "
        "the family's trunk; recovery may reuse their KV); `private`: this request's own; "
        "`instruction`: the request's closing instruction (computed exactly).",
    )
    id: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="The segment's name: a recovery round names its output segments by it.",
    )

    @model_validator(mode="after")
    def _text_or_tokens(self) -> "SegmentSpec":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a segment needs exactly one of 'text' and 'token_ids'")
        return self


class MessageSpec(BaseModel):
    """What a chat request declares for one of its messages (`kmesh.messages`, one per message,
    in order; kmesh serve only): its segment id and role. The message is the segment: the text
    its chat template adds for it (kmesh/state/chat_codec.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="The message's segment id (a recovery round names it).",
    )
    role: Literal["shared", "private", "instruction"] | None = Field(
        default=None,
        description="The message's segment role (as a segment's `role`); absent: system "
        "messages shared, the others private.",
    )


class KMeshParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="The family this request belongs to. Inside vLLM, with a store, the "
        "family's trunk (its leading shared segments, or the whole prompt without segments) "
        "stays pinned in the store while the family is open.",
    )
    branches: int | None = Field(
        default=None,
        ge=1,
        description="The family closes once this many of its requests have finished on this "
        "engine (each engine counts its own). Needs `family`.",
    )
    close: bool = Field(
        default=False,
        description="The family closes when this request finishes. Needs `family`.",
    )
    segments: list[SegmentSpec] | None = Field(
        default=None,
        min_length=1,
        description="The prompt as segments: their concatenation is the prompt. kmesh serve "
        "takes them on /v1/completions (the prompt may then be left out); a plain vLLM server "
        "uses them only if their tokens spell the request's prompt.",
    )
    # kmesh serve turns them into `segments` (serve/jobs.py::message_segments).
    messages: list[MessageSpec] | None = Field(
        default=None,
        min_length=1,
        description="kmesh serve, chat completions only: one declaration per message, in "
        "order; each message becomes a segment.",
    )
    # See with_separated_segments.
    separator: str | None = Field(
        default=None,
        min_length=1,
        description="kmesh serve, /v1/completions only: split the prompt at this string "
        "instead of sending segments; every part is shared but the last, the instruction (the "
        "separator belongs to no part).",
    )
    recovery: RecoverySpec | None = Field(
        default=None,
        description="Fill the prompt's rows after the engine's own prefix hit from stored "
        "segment KV, recomputing a share of them.",
    )
    keep_output: bool = Field(
        default=False,
        description="Keep the KV of the tokens this request generates as an output segment of "
        "its tenant: later requests' recovery reuses it wherever a segment holds those tokens "
        "(not under a LoRA adapter).",
    )
    # kmesh/vllm/tail_claims.py.
    page_tails: bool = Field(
        default=True,
        description="Inside vLLM: take (and leave for later requests) the rows of partly used "
        "pages that earlier requests of the engine computed; false: vLLM's own whole-page "
        "prefix caching only. The reference engine ignores it (it reuses whole 16-token "
        "blocks; its forks continue below a block on their own).",
    )
    # coord/future_use.py: the store's future-use retention.
    next_use: float | None = Field(
        default=None,
        ge=0.0,
        description="When this request's transcript is read again (an ordinal or a time, "
        "smaller is sooner): with a store, the entries its recovery restored or published stay "
        "pinned for its family at that date until the family closes, and the store evicts the "
        "furthest date first. Needs `family` and `recovery`; null: published unpinned.",
    )

    @model_validator(mode="after")
    def _check_references(self) -> "KMeshParams":
        if self.family is None and (self.branches is not None or self.close):
            raise ValueError("'branches' and 'close' need a 'family'")
        if self.next_use is not None and (self.family is None or self.recovery is None):
            raise ValueError(
                "'next_use' needs a 'family' (its pins end when the family closes) and "
                "'recovery' (what it pins is the transcript recovery restores and publishes)"
            )
        given = [n for n in ("segments", "separator", "messages") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of 'segments', 'separator' and 'messages', not {given}")
        round_ = None if self.recovery is None else self.recovery.round
        if round_ is not None:
            if self.family is None:
                raise ValueError("a recovery round needs a 'family' (its rounds share a context)")
            ids = {s.id for s in self.segments or []} | {m.id for m in self.messages or []}
            missing = [i for i in round_.segments if i not in ids]
            if missing:
                raise ValueError(f"recovery.round.segments names unknown segment ids {missing}")
        return self

    @property
    def prompt_text(self) -> str | None:
        """The prompt the segments spell, or None without segments (or with token-id ones)."""
        if self.segments is None or any(s.text is None for s in self.segments):
            return None
        return "".join(s.text or "" for s in self.segments)


def with_separated_segments(params: KMeshParams, prompt: str | None) -> KMeshParams:
    """`params` with explicit segments split from a separated prompt (the separator codec,
    kmesh.state.separator_codec: the parts are the segments, the separator belongs to none of
    them); unchanged without a separator."""
    if params.separator is None:
        return params
    if not prompt:
        raise InvalidRequestError("kmesh.separator needs the prompt text to split")
    try:
        parts = split_text(prompt, params.separator)
    except ContractError as error:
        raise InvalidRequestError(f"kmesh.separator: {error}") from None
    segments = [SegmentSpec(text=part, role="shared") for part in parts[:-1]]
    segments.append(SegmentSpec(text=parts[-1], role="instruction"))
    return params.model_copy(update={"segments": segments, "separator": None})


def parse_kmesh_params(value: object) -> KMeshParams:
    """Validate a caller's `kmesh` object; InvalidRequestError says what is wrong."""
    try:
        return KMeshParams.model_validate(value)
    except ValidationError as error:
        problems = "; ".join(
            f"kmesh.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
            for e in error.errors()
        )
        raise InvalidRequestError(f"malformed kmesh field: {problems}") from None


def segment_spans(tokenizer: Any, params: KMeshParams) -> tuple[list[int], list[Span]]:
    """The prompt's token ids as the concatenation of each segment's own tokens (so segment
    boundaries fall on token boundaries, and every engine sees the same ids), and each
    segment's span in them ([start, end), role, id). A prompt whose first segment is text
    starts with the tokenizer's own start tokens (BOS, for a tokenizer that adds one); a first
    segment given as token ids carries whatever the prompt starts with."""
    if params.segments is None:
        raise InvalidRequestError("kmesh.segments is missing: there is nothing to encode")
    given = params.segments and params.segments[0].token_ids is not None
    ids: list[int] = [] if given else list(tokenizer("", add_special_tokens=True)["input_ids"])
    spans = []
    for segment in params.segments:
        start = len(ids)
        if segment.token_ids is not None:
            ids.extend(segment.token_ids)
        else:
            ids.extend(tokenizer(segment.text, add_special_tokens=False)["input_ids"])
        spans.append(Span(start, len(ids), Role(segment.role), segment.id))
    return ids, spans
