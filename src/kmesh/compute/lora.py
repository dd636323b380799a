"""LoRA adapters as the executor applies them: y = W x + scaling * B (A x), from a position on.

An adapter is read from a peft folder (adapter_config.json + adapter_model.safetensors) and acts
on the attention projections q_proj, k_proj, v_proj and o_proj; other targets (the MLP's, DoRA,
biases, per-module ranks) are refused with a clear error rather than served wrong.

Where it applies (`activation_start`):
- a plain adapter applies to every token of the request (start 0);
- an activated adapter (Activated LoRA, peft's `alora_invocation_tokens`) applies from the start
  of the LAST occurrence of its invocation sequence in the prompt on, as peft computes it, and
  not at all when the prompt lacks the sequence. Every token before the start is therefore
  computed exactly as the base model computes it: its KV is base-model state.

`fingerprint` is SHA-256 over the adapter's files: the `adapter` part of state keys, so two
adapters that share a name never share state.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kmesh.compute.fingerprint import fingerprint_files
from kmesh.errors import InvalidRequestError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_PREFIX = "base_model.model.model.layers."


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    fingerprint: str
    rank: int
    scaling: float
    # (layer index, projection name) -> (A [rank, in_features], B [out_features, rank])
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # Activated LoRA's invocation sequence; None for a plain adapter.
    invocation_tokens: tuple[int, ...] | None = None

    @property
    def activated(self) -> bool:
        return self.invocation_tokens is not None

    @property
    def key(self) -> str:
        """The adapter's identity in state keys."""
        return f"{self.name}:{self.fingerprint}"

    def activation_start(self, token_ids: Sequence[int]) -> int | None:
        """First position of `token_ids` (a prompt) the adapter applies to; None: nowhere."""
        if self.invocation_tokens is None:
            return 0
        starts = invocation_starts(self.invocation_tokens, token_ids)
        return starts[-1] if starts else None

    def delta(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor | None:
        """scaling * B (A x) for inputs x [n, in_features], or None if the adapter leaves this
        projection alone. Computed in x's dtype."""
        pair = self.weights.get((layer, projection))
        if pair is None:
            return None
        a, b = pair
        return (x @ a.to(x.dtype).T) @ (b.to(x.dtype).T * self.scaling)


def invocation_starts(invocation: Sequence[int], token_ids: Sequence[int]) -> list[int]:
    """Every position where `invocation` occurs in `token_ids`, in order (overlaps included)."""
    wanted, n = list(invocation), len(invocation)
    return [
        start
        for start in range(len(token_ids) - n + 1)
        if list(token_ids[start : start + n]) == wanted
    ]


@dataclass(frozen=True, slots=True)
class LoraUse:
    """An adapter applied to one sequence from position `start` on."""

    adapter: LoraAdapter
    start: int

    @classmethod
    def of(cls, adapter: LoraAdapter | None, prompt_ids: Sequence[int]) -> "LoraUse | None":
        """How `adapter` applies to a request with this prompt (None: the base model)."""
        if adapter is None:
            return None
        start = adapter.activation_start(prompt_ids)
        return None if start is None else cls(adapter, start)


def load_adapter(
    path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None
) -> LoraAdapter:
    """Read a peft LoRA folder; `name` defaults to the folder's name."""
    folder = Path(path).expanduser()
    config_file = folder / "adapter_config.json"
    weights_file = folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise InvalidRequestError(
            f"{str(folder)!r} is not a LoRA adapter folder: it needs adapter_config.json and "
            "adapter_model.safetensors (peft's save_pretrained writes both)"
        )
    config = json.loads(config_file.read_text())
    _check_config(config, folder)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    tensors = load_file(weights_file)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        layer_text, _, projection = module.removeprefix(_PREFIX).partition(".self_attn.")
        if not module.startswith(_PREFIX) or projection not in PROJECTIONS:
            raise InvalidRequestError(
                f"adapter {str(folder)!r} targets {module!r}: KMesh applies LoRA to "
                f"{', '.join(PROJECTIONS)} of the decoder layers only"
            )
        b = tensors[f"{module}.lora_B.weight"]
        weights[(int(layer_text), projection)] = (a.to(dtype), b.to(dtype))
    invocation = config.get("alora_invocation_tokens")
    return LoraAdapter(
        name=name or folder.name,
        fingerprint=fingerprint_files([config_file, weights_file]),
        rank=rank,
        scaling=scaling,
        weights=weights,
        invocation_tokens=None if not invocation else tuple(int(t) for t in invocation),
    )


def _check_config(config: Mapping[str, object], folder: Path) -> None:
    refusals = {
        "peft_type": (config.get("peft_type") != "LORA", "is not a LoRA adapter"),
        "use_dora": (bool(config.get("use_dora")), "uses DoRA"),
        "bias": (config.get("bias", "none") != "none", "trains biases"),
        "rank_pattern": (bool(config.get("rank_pattern")), "has per-module ranks"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "has per-module alphas"),
    }
    for field, (refused, why) in refusals.items():
        if refused:
            raise InvalidRequestError(
                f"adapter {str(folder)!r} {why} ({field} = {config.get(field)!r}): KMesh serves "
                "plain and activated LoRA adapters with one rank and alpha"
            )


def lora_rows(
    uses: Sequence[tuple["LoraUse | None", torch.Tensor]],
) -> list[tuple[LoraAdapter, torch.Tensor]]:
    """Per adapter of a batch whose sequences are (use, positions) in order, the rows (of all
    the batch's tokens) it applies to: a sequence's tokens at positions >= its use's start."""
    rows: dict[int, tuple[LoraAdapter, list[torch.Tensor]]] = {}
    offset = 0
    for use, positions in uses:
        if use is not None:
            active = (positions >= use.start).nonzero().flatten() + offset
            rows.setdefault(id(use.adapter), (use.adapter, []))[1].append(active)
        offset += len(positions)
    return [(adapter, torch.cat(parts)) for adapter, parts in rows.values()]


def add_lora(
    adapter_rows: list[tuple[LoraAdapter, torch.Tensor]],
    layer: int,
    projection: str,
    x: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Add each adapter's delta of `projection` to its rows of `out` (in place)."""
    for adapter, rows in adapter_rows:
        if len(rows) == 0:
            continue
        delta = adapter.delta(layer, projection, x[rows])
        if delta is not None:
            out.index_add_(0, rows, delta.to(out.dtype))
