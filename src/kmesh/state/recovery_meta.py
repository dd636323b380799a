"""The `recovery` part of the `kmesh` object (kmesh/state/request_meta.py): an All-Gather round,
the policy or quality target that fills a prompt's rows after the local prefix hit, and the rule
that serves approximate recovery only to a request that asked for it.
"""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kmesh.errors import InvalidRequestError

# Approximate recovery is served only under a cache_salt starting with this: vLLM's prefix cache
# files blocks under the salt, so approximate KV never reaches a request that did not ask for it.
APPROX_SALT_PREFIX = "kmesh-approx"
MAX_NAME_CHARS = 200
# recovery.quality's targets (kmesh/recovery/quality.py).
QUALITY_TARGET = re.compile(r"exact|greedy|kl:(?P<kl>[0-9]*\.?[0-9]+(?:[eE]-?[0-9]+)?)")


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
        "every sibling; each must be a segment (or message) id of this request, named once, and "
        "the round's segments lie side by side in the prompt (in any order).",
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

    @model_validator(mode="after")
    def _each_segment_once(self) -> "RoundSpec":
        repeated = sorted({i for i in self.segments if self.segments.count(i) > 1})
        if repeated:
            raise ValueError(
                f"recovery.round.segments names {repeated} more than once: name each output once"
            )
        return self


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

    # kmesh/recovery/policies.py: POLICIES (a test keeps them the same).
    policy: Literal[
        "none",
        "full",
        "kv_deviation",
        "first_k",
        "random",
        "query",
        "first_k+kv_deviation",
        "first_k+query",
    ] = Field(
        default="full",
        description="Which reused tokens are recomputed: `full` all of them (exact up to float "
        "rounding); `kv_deviation` those whose keys at `check_layer` deviate most from the "
        "reused ones (CacheBlend); `first_k` the first ones of every reused segment (EPIC); "
        "`query` those the prompt's own new tokens (its instruction and question after the "
        "reused ones) attend to most at `check_layer` (ProphetKV; a region without new tokens "
        "gets `first_k`'s choice); `first_k+kv_deviation` and `first_k+query` half of the "
        "budget (rounded up) as `first_k`, the rest by the other rule among the remaining "
        "ones; `random` random ones; `none` none. Every policy but `full` is approximate.",
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
    check_layer: int | None = Field(
        default=None,
        ge=1,
        description="The layer whose keys `kv_deviation` and the gate compare, and whose "
        "attention `query` measures (layer 0 cannot deviate; below the model's layers). Null: "
        "the model's default, layer 1, or on a model with sliding-window layers its first "
        "global layer (5 on Gemma 3).",
    )
    # kmesh/recovery/recover.py: GATE_SAMPLE_MAX.
    gate_sample: float = Field(
        default=0.125,
        gt=0.0,
        le=1.0,
        description="Share of the reused tokens the gate checks when the policy needs no "
        "deviation of every one (ratio 0, or any policy but `kv_deviation` and "
        "`first_k+kv_deviation`); below 1.0, at most 64 per region.",
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
