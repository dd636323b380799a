"""Quality targets: what a caller asks of recovery instead of a policy and a ratio
(`recovery.quality`, both engines; `kmesh serve --reuse-messages --quality`).

- "exact": no approximation: the request is served as an ordinary one, its prompt computed by the
  engine itself after its prefix hits.
- "kl:<x>": the cheapest calibrated setting whose next-token KL p95 against full prefill was at
  most x on every trace it was measured on.
- "greedy": the cheapest calibrated setting whose outputs, generated closed loop from its own
  state, were identical to full prefill's in at least GREEDY_SHARE of every round's agents on
  every trace it was measured on.

A calibration is one setting of the recovery knobs measured by `kmesh bench allgather --frontier`
on several traces (`kmesh bench calibrate`: its worst figures) for one model (its fingerprint) and
one kind of request: "round" (a declared round: collective recovery) or "request" (per-request
recovery). Only settings cheaper than vanilla prefix caching count. A target that no calibration
of the request's model and kind meets is served exactly, as is every target on a model without
calibrations; the request's stats say which: `quality: {"target", "served": <setting> | "exact",
"reason"?}`. A target is never met silently by a setting the data did not show meeting it.

Exact service is exact within the request's salt: a prefix hit under an approximate salt may be a
block that salt's approximate requests left (the salt is the namespace approximate KV lives in),
so a caller mixing targets sends each under a salt of its own.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kmesh.state.recovery_meta import QUALITY_TARGET, RecoverySpec

# "greedy": the least share of a round's outputs identical to full prefill's.
GREEDY_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Calibration:
    model: str  # the model's fingerprint (compute/fingerprint.py)
    kind: str  # "round" or "request"
    label: str  # the frontier point, e.g. "collective@agent_ratio=0.3,master=sibling"
    ratio: float  # the recovery's ratio (a round: its agents' ratio)
    master: str | None  # a round's master choice
    gate: float | None  # the gate's threshold: a region deviating more is computed exactly
    # The worst over its traces: the next-token KL p95 against full prefill, the least
    # closed-loop identical share of a round >= 1, closed-loop tokens over prefix caching's.
    kl_p95: float
    identical_min: float
    tokens_over_prefix: float


# The embedded model (SmolLM2-135M-Instruct, float32), through vLLM 0.32 with KMeshConnector:
# `kmesh bench calibrate --frontiers docs/results/frontier/allgather-8x3-vllm.json,
# docs/results/frontier/allgather-8x3-seed1-vllm.json` (two 8-agent, 3-round All-Gather traces,
# seeds 0 and 1), the settings no other beats on both KL p95 and tokens. No setting keeps a
# round's outputs identical to full prefill's (the best least round is 0.125), so "greedy" is
# served exactly; docs/design/collective-recovery.md, "Quality targets instead of knobs".
EMBEDDED = "9dc0bdf2075e27a94f59a01c2f1c52b6e9429b23dbd9992351a18c5485bd6382"
# kind, label (the frontier point's knobs), ratio, master, gate, KL p95, identical_min, tokens
_EMBEDDED_ROWS: tuple[tuple[str, str, float, str | None, float, float, float, float], ...] = (
    ("round", "collective agent_ratio=0 sibling", 0.0, "sibling", 0.1, 0.1417, 0.0, 0.242),
    ("round", "collective agent_ratio=0 common", 0.0, "common", 0.1, 0.0671, 0.0, 0.248),
    ("round", "collective agent_ratio=0.3 sibling", 0.3, "sibling", 0.1, 0.0255, 0.0, 0.508),
    ("round", "collective gate=0.0125 sibling", 0.0, "sibling", 0.0125, 0.0099, 0.125, 0.677),
    ("request", "per_request recompute_ratio=0.15", 0.15, None, 0.1, 0.1343, 0.0, 0.44),
    ("request", "per_request recompute_ratio=0.3", 0.3, None, 0.1, 0.0651, 0.0, 0.535),
    ("request", "per_request recompute_ratio=0.7", 0.7, None, 0.1, 0.0139, 0.0, 0.786),
    ("request", "per_request recompute_ratio=0.9", 0.9, None, 0.1, 0.0024, 0.0, 0.899),
)
CALIBRATIONS: tuple[Calibration, ...] = tuple(Calibration(EMBEDDED, *row) for row in _EMBEDDED_ROWS)


def meets(target: str, calibration: Calibration) -> bool:
    if target == "greedy":
        return calibration.identical_min >= GREEDY_SHARE
    found = QUALITY_TARGET.fullmatch(target)
    assert found is not None and found["kl"] is not None
    return calibration.kl_p95 <= float(found["kl"])


def resolve_quality(
    spec: RecoverySpec, model: str, calibrations: Sequence[Calibration] | None = None
) -> tuple[RecoverySpec | None, dict[str, Any] | None]:
    """The recovery a request's quality target resolves to (None: served exactly, without
    recovery) and what its stats say of it (None when it names no target); `calibrations`:
    CALIBRATIONS unless given."""
    calibrations = CALIBRATIONS if calibrations is None else calibrations
    target = spec.quality
    if target is None:
        return spec, None
    if target == "exact":
        return None, {"target": target, "served": "exact"}
    kind = "round" if spec.round is not None else "request"
    met = [
        c
        for c in calibrations
        if c.model == model and c.kind == kind and c.tokens_over_prefix < 1 and meets(target, c)
    ]
    if not met:
        reason = (
            f"no recovery setting measured on this model for a {kind} meets {target!r} at less "
            "compute than prefix caching (kmesh.recovery.quality)"
        )
        return None, {"target": target, "served": "exact", "reason": reason}
    best = min(met, key=lambda c: c.tokens_over_prefix)
    update: dict[str, Any] = {
        "policy": "kv_deviation",
        "ratio": best.ratio,
        "gate": best.gate,
        "quality": None,
    }
    if spec.round is not None and best.master is not None:
        update["round"] = spec.round.model_copy(update={"master": best.master})
    note = {"target": target, "served": best.label}
    return spec.model_copy(update=update), note
