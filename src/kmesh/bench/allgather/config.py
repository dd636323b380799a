"""The All-Gather bench's configuration, shared by both engines' benches (bench/allgather/run.py,
bench/allgather/vllm.py), the closed loop and the strategies' requests: the four strategies, the
recovery knobs with their valid ranges, and the sweep's grid.

Every field is checked on construction: a value out of range raises InvalidRequestError naming the
command-line flag that sets it.
"""

from dataclasses import dataclass, replace
from typing import Any

from kmesh.compute.config import ModelConfig
from kmesh.errors import InvalidRequestError
from kmesh.recovery.check_layer import check_layer_for
from kmesh.recovery.collective import MASTER_CHOICES
from kmesh.recovery.policies import POLICIES
from kmesh.recovery.quality import resolve_quality
from kmesh.recovery.recover import RecoveryConfig
from kmesh.state.recovery_meta import RecoverySpec, RoundSpec, check_quality_target

STRATEGIES = ("full", "prefix", "per_request", "collective")
SWEEP_POLICIES = ("kv_deviation", "first_k", "random", "none")
SWEEP_RATIOS = (0.0, 0.05, 0.15, 0.3)
# The reference engine's sweep, per policy and ratio: (label, strategy, the knob set to the ratio,
# other knobs). collective_shared is the common-context master without agent correction: the
# once-per-round recovery from the stored KV alone.
SWEEP_VARIANTS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("per_request", "per_request", "recompute_ratio", {}),
    ("collective", "collective", "agent_ratio", {}),
    ("collective_shared", "collective", "shared_ratio", {"agent_ratio": 0.0, "master": "common"}),
)
# The recovery settings: the fields a report's config lists and the command line sets (each by
# the flag of its name).
RECOVERY_FIELDS = (
    "policy",
    "master",
    "recompute_ratio",
    "shared_ratio",
    "agent_ratio",
    "check_layer",
    "gate",
    "gate_sample",
    "quality",
)


@dataclass(frozen=True, slots=True)
class AllGatherBenchConfig:
    policy: str = "kv_deviation"
    # collective: where each round's master comes from (recovery/collective.py).
    master: str = "sibling"
    # per_request: share of each agent's reused tokens recomputed in its own context.
    recompute_ratio: float = 0.3
    # collective: share of the round's outputs recomputed once in the common context (1.0: all
    # of them, the shared step is then a plain prefill of the outputs after the shared context) ...
    shared_ratio: float = 1.0
    # ... and share of each agent's reused blocks recomputed in its own context.
    agent_ratio: float = 0.0
    check_layer: int | None = None  # None: the model's (recovery/recover.py)
    # Quality gate: a region whose mean relative key deviation at the check layer exceeds this is
    # recomputed in full. Normal reuse on the embedded model deviates 0.006-0.022; garbage ~1.
    gate: float | None = 0.1
    # Share of a region's reused tokens the gate checks when no policy scores them all (recover.py).
    gate_sample: float = 0.125
    # A quality target in place of the approximate strategies' knobs (kmesh/recovery/quality.py):
    # each is served the setting it resolves to on the bench's model, or exactly.
    quality: str | None = None
    block_size: int = 16
    greedy_tokens: int = 32

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if self.master not in MASTER_CHOICES:
            raise InvalidRequestError(
                f"--master must be one of {MASTER_CHOICES}, got {self.master!r}"
            )
        for flag, value in (
            ("--recompute-ratio", self.recompute_ratio),
            ("--shared-ratio", self.shared_ratio),
            ("--agent-ratio", self.agent_ratio),
        ):
            if not 0.0 <= value <= 1.0:
                raise InvalidRequestError(f"{flag} must be between 0 and 1, got {value}")
        if self.check_layer is not None and self.check_layer < 1:
            raise InvalidRequestError(
                "--check-layer must be at least 1 (layer 0 keys depend on token and position only)"
            )
        if self.gate is not None and self.gate < 0:
            raise InvalidRequestError(f"--gate must be >= 0, got {self.gate}")
        if not 0.0 < self.gate_sample <= 1.0:
            raise InvalidRequestError(
                f"--gate-sample must be above 0 and at most 1, got {self.gate_sample}"
            )
        if self.quality is not None:
            check_quality_target(self.quality, "--quality")
        if self.block_size < 1 or self.greedy_tokens < 1:
            raise InvalidRequestError("block size and greedy tokens must be at least 1")

    def for_model(self, model: ModelConfig) -> "AllGatherBenchConfig":
        """This config with its check layer resolved on `model` (its default when not given),
        so that reports say which layer was checked."""
        try:
            return replace(self, check_layer=check_layer_for(self.check_layer, model))
        except ValueError as error:
            raise InvalidRequestError(f"--check-layer: {error}") from None

    def recovery(self, ratio: float) -> RecoveryConfig:
        policy = "full" if ratio >= 1.0 else self.policy
        return RecoveryConfig(
            policy, ratio, self.check_layer, self.gate, gate_sample=self.gate_sample
        )

    def resolved(self, strategy: str, model: str) -> "AllGatherBenchConfig | None":
        """The knobs the quality target resolves to for approximate `strategy` (per_request: a
        request; collective: a round) on `model`; None: served exactly; itself without a target."""
        if self.quality is None:
            return self
        round_ = RoundSpec(id="r", segments=["s"]) if strategy == "collective" else None
        spec, _ = resolve_quality(RecoverySpec(quality=self.quality, round=round_), model)
        if spec is None:
            return None
        knobs = replace(self, quality=None, policy=spec.policy, gate=spec.gate)
        if spec.round is None:
            return replace(knobs, recompute_ratio=spec.ratio)
        return replace(knobs, agent_ratio=spec.ratio, master=spec.round.master)

    def recovery_fields(self) -> dict[str, Any]:
        """The recovery settings as a report's config lists them (both engines' reports)."""
        return {name: getattr(self, name) for name in RECOVERY_FIELDS}
