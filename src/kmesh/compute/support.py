"""What KMesh does with a model, mechanism by mechanism: exact, approximate, or refused and why.

Read from the model's description (compute/config.py) alone. A mechanism that would be wrong on a
model is refused where it starts (`require`), in one line, never run; `kmesh model info` prints
the whole table. "exact" mechanisms are checked against recomputation for every family in
tests/compute/test_families.py and tests/vllm/test_families_vllm.py; "approximate" ones are
served only to a caller who asked for them, and measured (docs/benchmarks.md).
"""

from dataclasses import dataclass
from typing import Literal

from kmesh.compute.config import ModelConfig
from kmesh.errors import ModelNotSupportedError

Status = Literal["exact", "approximate", "refused"]


@dataclass(frozen=True, slots=True)
class Support:
    mechanism: str
    status: Status
    why: str  # what it rests on, or why it is refused
    # Checked on this family by the test suite (an exact mechanism's claim is checked there).
    tested: bool = True

    @property
    def label(self) -> str:
        return "exact, tested" if self.status == "exact" and self.tested else self.status


MECHANISMS = (
    "KMeshConnector in vLLM",
    "exact prefix sharing",
    "forks and page tails",
    "restore across instances",
    "Master-Mirror",
    "recovery",
    "collective recovery",
    "activated LoRA",
    "adapter residual",
)


def support(config: ModelConfig, mechanism: str) -> Support:
    """How `mechanism` (one of MECHANISMS) runs on the model."""
    windows = sorted({w for w in config.windows if w is not None})
    all_windowed = config.windowed and all(w is not None for w in config.windows)
    if mechanism == "KMeshConnector in vLLM":
        if all_windowed:
            return Support(
                mechanism,
                "refused",
                "every layer attends through a sliding window, so vLLM frees the pages outside "
                "it while a request runs; KMesh reads any page (the reference engine runs it)",
            )
        return Support(mechanism, "exact", "one KV cache group, every page kept")
    if mechanism in ("exact prefix sharing", "forks and page tails"):
        return Support(mechanism, "exact", "the engine's own KV pages, reused as they are")
    if mechanism == "restore across instances":
        # Tested per family through vLLM's store path, which refuses an all-windowed model.
        why = "the engine's own KV pages, stored and restored byte for byte"
        return Support(mechanism, "exact", why, tested=not all_windowed)
    if mechanism == "Master-Mirror":
        tables = len(config.rope_tables)
        return Support(
            mechanism,
            "exact",
            f"keys re-rotated by their layer's RoPE table ({tables} table"
            f"{'s' if tables > 1 else ''}), values as they are",
        )
    if mechanism in ("recovery", "collective recovery"):
        where = (
            f"; sliding-window layers (W={', '.join(map(str, windows))}) limit how far a "
            "deviation travels"
            if windows
            else ""
        )
        return Support(
            mechanism, "approximate", f"selected rows recomputed, the rest reused{where}"
        )
    if mechanism == "activated LoRA":
        return Support(
            mechanism,
            "exact",
            "the base model's KV before the adapter's invocation (tested on Llama models)",
            tested=config.family == "llama",
        )
    if mechanism == "adapter residual":
        if config.qk_norm:
            return Support(
                mechanism,
                "refused",
                "QK-norm makes a key nonlinear in its pre-RoPE projection, which the residual "
                "approximation assumes linear",
            )
        return Support(
            mechanism, "approximate", "the base model's KV plus each adapter's rank-r residual"
        )
    raise ValueError(f"unknown mechanism {mechanism!r}; one of {', '.join(MECHANISMS)}")


def support_table(config: ModelConfig) -> list[Support]:
    return [support(config, mechanism) for mechanism in MECHANISMS]


def require(config: ModelConfig, mechanism: str) -> None:
    """Raise ModelNotSupportedError where `mechanism` is refused on the model."""
    entry = support(config, mechanism)
    if entry.status == "refused":
        raise ModelNotSupportedError(
            f"{mechanism} is refused on this {config.family} model: {entry.why}"
        )
