"""An adapter's KV of a shared context, approximated from the base model's (ForkKV, LRAgent).

For a context token with hidden state h in some layer, an adapter X's exact K and V are

    K_X = RoPE(W_k h_X + s B_k A_k h_X)        V_X = W_v h_X + s B_v A_v h_X

where h_X is X's own hidden state there. The approximation takes h_X ~ h (the base model's):

    K_X ~ K + RoPE(s B_k r_k)                  V_X ~ V + s B_v r_v,    r = A h   [tokens, rank]

so the context is computed once by the base model (`compute_base`: its KV, and for each adapter
the rank-r projections r_k, r_v captured on the way), and each adapter keeps only r_k and r_v:
rank / (kv_heads * head_dim) of a KV each (8 / 192 on the embedded model). It is exact in layer 0
(h is the embedding) and drifts after it, as the adapter's effect on q, o and the residual stream
is left out for the context tokens. The adapter's own tokens after the context are computed
exactly, under the adapter, against this context.

The gate (`adapter_context`): the last `check_tokens` of the context are recomputed under the
adapter against the approximate KV before them, and their recomputed K and V are compared with
the approximate ones; the relative deviation (Frobenius norm of the difference over that of the
recomputed KV, all layers) above `max_deviation` refuses the approximation: the caller then
computes the context exactly under the adapter. Accepted, the recomputed rows replace the
approximate ones. The result is approximate state: served only to callers who asked for it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.lora import LoraAdapter, LoraUse
from kmesh.compute.support import require
from kmesh.recovery.residual_defaults import DEFAULT_CHECK_TOKENS, DEFAULT_MAX_DEVIATION


@dataclass(frozen=True, slots=True)
class ResidualConfig:
    check_tokens: int = DEFAULT_CHECK_TOKENS
    max_deviation: float = DEFAULT_MAX_DEVIATION


@dataclass(frozen=True, slots=True)
class LowRank:
    """One adapter's residual of the context: per layer r_k and r_v, [tokens, rank] (None where
    the adapter leaves k_proj / v_proj alone)."""

    k: list[torch.Tensor | None]
    v: list[torch.Tensor | None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)


@dataclass(frozen=True, slots=True)
class SharedBase:
    """The base model's state of a context, and each adapter's residual of it (by adapter key)."""

    token_ids: torch.Tensor  # [n]
    kv: DenseKV  # the base model's, positions 0..n-1
    residuals: dict[str, LowRank]
    # Next-token logits after the context under the base model, [vocab].
    logits: torch.Tensor


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """The outcome of `adapter_context`: the approximate KV (None when the gate refused)."""

    kv: DenseKV | None
    deviation: float
    computed_tokens: int  # the check tokens the gate recomputed
    residual_bytes: int


def compute_base(
    executor: Executor, token_ids: Sequence[int], adapters: Sequence[LoraAdapter]
) -> SharedBase:
    """Run the context once through the base model, capturing each adapter's r_k and r_v.
    Refused (ModelNotSupportedError) on a model whose keys the approximation does not fit."""
    require(executor.config, "adapter residual")
    tokens = torch.tensor(list(token_ids))
    low_rank = {a.key: LowRank([], []) for a in adapters}

    def capture(layer: int, h: torch.Tensor) -> None:
        for adapter in adapters:
            parts = low_rank[adapter.key]
            for projection, out in (("k_proj", parts.k), ("v_proj", parts.v)):
                pair = adapter.weights.get((layer, projection))
                out.append(None if pair is None else h @ pair[0].to(h.dtype).T)

    [out] = executor.forward(
        [SequenceInput(tokens, torch.arange(len(tokens)))], on_layer_input=capture
    )
    kv = out.as_context(torch.arange(len(tokens)))
    return SharedBase(tokens, kv, low_rank, executor.logits(out.hidden[-1:])[0])


def approximate_kv(executor: Executor, base: SharedBase, adapter: LoraAdapter) -> DenseKV:
    """The base KV plus the adapter's residual, over the whole context."""
    cfg = executor.config
    residual = base.residuals[adapter.key]
    ks, vs = [], []
    for layer in range(cfg.num_layers):
        k, v = base.kv.layer(layer)
        r_k, r_v = residual.k[layer], residual.v[layer]
        if r_k is not None:
            b = adapter.weights[(layer, "k_proj")][1].to(r_k.dtype)
            delta = (r_k @ b.T * adapter.scaling).view(-1, cfg.num_kv_heads, cfg.head_dim)
            k = k + executor.rotate(delta, base.kv.positions, layer)
        if r_v is not None:
            b = adapter.weights[(layer, "v_proj")][1].to(r_v.dtype)
            v = v + (r_v @ b.T * adapter.scaling).view(-1, cfg.num_kv_heads, cfg.head_dim)
        ks.append(k)
        vs.append(v)
    return DenseKV(base.kv.positions, ks, vs)


def adapter_context(
    executor: Executor, base: SharedBase, adapter: LoraAdapter, cfg: ResidualConfig
) -> AdapterContext:
    """The adapter's approximate KV of the context, gated (see the module docstring)."""
    approx = approximate_kv(executor, base, adapter)
    n = len(base.token_ids)
    check = min(cfg.check_tokens, n)
    head = n - check
    before = DenseKV(
        approx.positions[:head], [k[:head] for k in approx.k], [v[:head] for v in approx.v]
    )
    [out] = executor.forward(
        [
            SequenceInput(
                base.token_ids[head:], torch.arange(head, n), before, lora=LoraUse(adapter, 0)
            )
        ]
    )
    diff = sum(
        (out.k[i] - approx.k[i][head:]).float().pow(2).sum()
        + (out.v[i] - approx.v[i][head:]).float().pow(2).sum()
        for i in range(executor.config.num_layers)
    )
    norm = sum(
        out.k[i].float().pow(2).sum() + out.v[i].float().pow(2).sum()
        for i in range(executor.config.num_layers)
    )
    deviation = float((torch.as_tensor(diff) / torch.as_tensor(norm).clamp_min(1e-30)).sqrt())
    residual_bytes = base.residuals[adapter.key].nbytes
    if deviation > cfg.max_deviation:
        return AdapterContext(None, deviation, check, residual_bytes)
    kv = DenseKV(
        approx.positions,
        [torch.cat((k[:head], new)) for k, new in zip(approx.k, out.k, strict=True)],
        [torch.cat((v[:head], new)) for v, new in zip(approx.v, out.v, strict=True)],
    )
    return AdapterContext(kv, deviation, check, residual_bytes)
