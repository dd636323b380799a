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

`recovery` asks KMeshConnector to fill the prompt's blocks after vLLM's local prefix hit itself
(kmesh/recovery/requests.py), e.g. an All-Gather sibling:

    {"family": "council",
     "segments": [..., {"token_ids": [...], "role": "shared", "id": "out-0-3"}, ...],
     "recovery": {"policy": "kv_deviation", "ratio": 0.0, "gate": 0.1,
                  "round": {"id": "r1", "segments": ["out-0-0", ..., "out-0-7"]}}}
"""

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kmesh.errors import ContractError, InvalidRequestError
from kmesh.state.segments import Role, Span
from kmesh.state.separator_codec import split_text

KMESH_PARAMS_KEY = "kmesh"
# Approximate recovery is served only under a cache_salt starting with this: vLLM's prefix cache
# files blocks under the salt, so approximate KV never reaches a request that did not ask for it.
APPROX_SALT_PREFIX = "kmesh-approx"
MAX_NAME_CHARS = 200
# recovery.quality's targets (kmesh/recovery/quality.py).
QUALITY_TARGET = re.compile(r"exact|greedy|kl:(?P<kl>[0-9]*\.?[0-9]+(?:[eE]-?[0-9]+)?)")


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


class RoundSpec(BaseModel):
    """An All-Gather round: the siblings that read the same outputs name the same round id and
    list the ids of the round's output segments (canonical order). KMeshConnector recovers those
    outputs once per round (the master) and places them in each sibling (its mirror)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="The round's id: every sibling of the round sends the same one.",
    )
    segments: list[str] = Field(
        min_length=1,
        description="The ids of the round's output segments, in the same (canonical) order for "
        "every sibling; each must be a segment (or message) id of this request.",
    )
    # kmesh/recovery/collective.py builds the master.
    master: Literal["sibling", "common"] = Field(
        default="sibling",
        description="Where the round's master comes from: `sibling`, the round's first sibling "
        "computed exactly; `common`, the outputs recovered after the family's common context, "
        "recomputing `shared_ratio` of them.",
    )
    shared_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="With master `common`: the share of the outputs recomputed (1.0: computed "
        "in full).",
    )


class RecoverySpec(BaseModel):
    """Recovery of the prompt's rows after the engine's local prefix hit (the same in both engines,
    kmesh/recovery/requests.py): each claims every row after the hit but the prompt's last (vLLM,
    for policy full, whole pages only), and KMesh's executor fills them (on vLLM's own weights
    inside vLLM). Policy "full" recomputes every claimed token (exact up to float rounding) but a
    kept tail's (recovery/prefix_tails.py) or a transcript's restored from the store
    (store/shared/transcripts.py: an earlier job's rows under the same salt); the other policies,
    and every round, reuse stored segment KV or the round's master, re-rotated, and recompute
    `ratio` of it: approximate, so they need a cache_salt starting with APPROX_SALT_PREFIX (the
    prefix cache then keeps their blocks apart from exact requests). A region whose check-layer key
    deviation exceeds `gate` is left to the engine's own prefill. `quality`, a target in place of
    policy and ratio, is resolved by each engine to a setting or to exact service
    (kmesh/recovery/quality.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["none", "full", "kv_deviation", "first_k", "random"] = Field(
        default="full",
        description="Which reused tokens are recomputed: `full` all of them (exact up to float "
        "rounding); `kv_deviation` those whose keys at `check_layer` deviate most from the "
        "reused ones (CacheBlend); `first_k` the first ones of every reused segment (EPIC); "
        "`random` random ones; `none` none. Every policy but `full` is approximate.",
    )
    ratio: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description="Share of the reused tokens recomputed (ignored by `full` and `none`).",
    )
    gate: float | None = Field(
        default=0.1,
        ge=0.0,
        description="A region whose mean relative key deviation at `check_layer` exceeds this "
        "is left to the engine's own prefill (null: no gate).",
    )
    check_layer: int = Field(
        default=1,
        ge=1,
        description="The layer whose keys `kv_deviation` and the gate compare (layer 0 cannot "
        "deviate).",
    )
    # kmesh/recovery/recover.py: GATE_SAMPLE_MAX.
    gate_sample: float = Field(
        default=0.125,
        gt=0.0,
        le=1.0,
        description="Share of the reused tokens the gate checks when the policy scores none "
        "(ratio 0, `first_k`, `random`, `none`); below 1.0, at most 64 per region.",
    )
    round: RoundSpec | None = Field(
        default=None,
        description="An All-Gather round this request is a sibling of (approximate).",
    )
    quality: str | None = Field(
        default=None,
        description="A quality target in place of `policy` and `ratio`: `exact`, `greedy` or "
        "`kl:<x>`; each engine resolves it to a calibrated setting or to exact service.",
    )

    @model_validator(mode="after")
    def _target_or_knobs(self) -> "RecoverySpec":
        if self.quality is None:
            return self
        if QUALITY_TARGET.fullmatch(self.quality) is None:
            raise ValueError(
                f"recovery.quality must be 'exact', 'greedy' or 'kl:<x>' (e.g. kl:0.05), got "
                f"{self.quality!r}"
            )
        knobs = sorted({"policy", "ratio"} & self.model_fields_set)
        if knobs:
            raise ValueError(
                f"recovery.quality replaces {knobs}: send a quality target or the knobs, not both"
            )
        return self

    @property
    def approximate(self) -> bool:
        """Whether it may serve approximate KV (a quality target other than exact may)."""
        if self.quality is not None:
            return self.quality != "exact"
        return self.policy != "full" or self.round is not None


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


def check_quality_target(target: str, where: str) -> str:
    """`target` if it is a quality target; else InvalidRequestError naming `where` (a flag)."""
    if QUALITY_TARGET.fullmatch(target) is None:
        raise InvalidRequestError(f"{where} takes exact, greedy or kl:<x>, got {target!r}")
    return target


def recovery_refusal(spec: RecoverySpec, cache_salt: str | None, adapter: str | None) -> str | None:
    """Why a request's recovery is refused (it is then computed exactly), or None. Both engines:
    recovery runs base-model layers only, and approximate KV lives only under an approximate salt
    (the prefix cache files blocks under the salt, so it never reaches an exact request)."""
    if adapter is not None:
        return "recovery serves base-model requests only (this one has a LoRA adapter)"
    if spec.approximate and not (cache_salt or "").startswith(APPROX_SALT_PREFIX):
        return (
            f"approximate recovery needs a cache_salt starting with {APPROX_SALT_PREFIX!r} "
            "(so its blocks stay out of exact requests' prefix hits); computed exactly instead"
        )
    return None


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
    segment's span in them ([start, end), role, id)."""
    if params.segments is None:
        raise InvalidRequestError("kmesh.segments is missing: there is nothing to encode")
    ids: list[int] = list(tokenizer("", add_special_tokens=True)["input_ids"])
    spans = []
    for segment in params.segments:
        start = len(ids)
        if segment.token_ids is not None:
            ids.extend(segment.token_ids)
        else:
            ids.extend(tokenizer(segment.text, add_special_tokens=False)["input_ids"])
        spans.append(Span(start, len(ids), Role(segment.role), segment.id))
    return ids, spans
