"""Layerwise decoder executor: compute any tokens, at any positions, against any given KV.

This is the primitive the rest of KMesh stands on. A forward takes, per sequence, the token ids to
compute, their positions, and the KV they may attend to (with that KV's positions). Causality is by
position: a token at position p attends to every given or new key whose position is <= p, wherever
it sits in the inputs. So computing tokens [a, b) against the cached KV of [0, a) equals computing
[0, b) at once, and an arbitrary set of positions computed against exact KV of all the others
equals the full computation at those positions.

Keys are returned (and expected) after RoPE, so stored KV is position-bound.

The model is what its description says (compute/config.py), layer by layer: a sliding-window
layer's token at p attends to keys at positions p - W + 1 .. p only; each layer turns q and k by
its own RoPE table; QK-norm, biases, Gemma's (1 + w) and sandwich norms, the embedding scale and
the attention scale are applied where the description has them. In a sliding-window layer every
key a sequence may see (shared, context and new) is attended together under that layer's mask.

Every tensor a caller passes (token ids, positions, KV) lives on the weights' device
(`Executor.device`: the CPU, or a GPU); what the executor makes lives there too.

Tensors flow in the weights' dtype (float32 or bfloat16); what rounds badly in bfloat16 is done in
float32 as vLLM's Llama does on CPU, so that the executor on vLLM's modules computes what vLLM
computes: the RMS norms (vLLM's native rms_norm: normalized in float32, rounded, then times the
weight), RoPE (compute/rope.py), attention's scores and softmax (inside torch's
scaled_dot_product_attention; compute/attention.py). Residual adds round once, like vLLM's
fused add. Temporaries in float32 are per layer; KV is kept in the weights' dtype.

A sequence's `shared` context (a prefix every new token sees in full: a recovered region's exact
prefix, a fork's trunk) is attended without a mask, once for all the sequences of a batch that
hold the same object, and its own `context` and new tokens separately; the parts are merged
exactly by log-sum-exp (see compute/attention.py). Such a sequence's `context`, where it all
precedes the new tokens (a region's reused rows before its last tokens), is attended apart too,
without a mask and without a copy next to the new keys. New tokens at increasing positions with no
`context` attend to each other causally (the kernel skips the blocks above the diagonal).

A sequence may carry a LoRA adapter (`SequenceInput.lora`, compute/lora.py): its deltas are added
to the attention projections of its tokens at positions >= the use's start, before RoPE; the
sequences of a batch may each use a different adapter (or none).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from kmesh.compute.attention import additive_mask, attend, attend_with_lse, merge
from kmesh.compute.config import ModelConfig, RopeTable
from kmesh.compute.lora import LoraUse, add_lora, lora_rows
from kmesh.compute.masks import causal_mask, context_precedes, shared_groups, window_mask
from kmesh.compute.rope import apply_rope, inverse_frequencies, rope_cos_sin
from kmesh.compute.weights import Layer, ModelWeights


class ContextKV(Protocol):
    """KV a sequence's new tokens may attend to: per layer [m, kv_heads, head_dim] K and V."""

    @property
    def positions(self) -> torch.Tensor:
        """Positions of the m entries, shape [m]."""
        ...

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class DenseKV:
    """Context KV held as one K and one V tensor per layer."""

    positions: torch.Tensor
    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]


@dataclass(frozen=True, slots=True)
class SequenceInput:
    token_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    context: ContextKV | None = None
    # Context every new token attends to in full (its positions all below theirs), without a
    # mask and without being copied next to the new keys; inputs of a batch that hold the same
    # object (a trunk they share) attend to it together. Attended before `context`.
    shared: ContextKV | None = None
    # The adapter this sequence runs under (None: the base model).
    lora: LoraUse | None = None


@dataclass(frozen=True, slots=True)
class SequenceOutput:
    hidden: torch.Tensor  # [n, hidden], after the final norm: feed to Executor.logits
    k: list[torch.Tensor]  # per layer run [n, kv_heads, head_dim], after RoPE
    v: list[torch.Tensor]  # per layer run [n, kv_heads, head_dim]
    residual: torch.Tensor  # [n, hidden], the residual stream after the last layer run

    def as_context(self, positions: torch.Tensor) -> DenseKV:
        """This output's KV as context for later tokens."""
        return DenseKV(positions, self.k, self.v)


class Executor:
    """Runs a batch of sequences through the model one layer at a time.

    Projections and MLPs run once over all sequences' tokens together; attention runs per sequence
    with torch's scaled_dot_product_attention and a by-position causal mask, except for shared
    contexts, attended once per group.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights) -> None:
        self.config = config
        self.weights = weights
        self.dtype = weights.embed_tokens.dtype
        self.device = weights.embed_tokens.device
        self._inv_freq = {
            table: inverse_frequencies(table).to(self.device) for table in config.rope_tables
        }
        # None where it is torch's default (1/sqrt(head_dim)): the kernels' own constant.
        scale = config.attention_scale
        self._scale = None if scale == config.head_dim**-0.5 else scale

    @torch.inference_mode()
    def forward(
        self,
        batch: Sequence[SequenceInput],
        layers: range | None = None,
        residual: Sequence[torch.Tensor] | None = None,
        on_layer_input: Callable[[int, torch.Tensor], None] | None = None,
    ) -> list[SequenceOutput]:
        """Run the batch through `layers` (default: all). A partial run starts from `residual`
        (the per-sequence `residual` of an earlier run that ended where this one starts) instead
        of the embeddings; an output's k/v lists then hold `layers` only. `hidden` is the final
        norm of the residual stream: meaningful (for logits) only after the last layer.
        `on_layer_input(layer, h)` sees each layer's normed input to the q/k/v projections,
        [all tokens of the batch, hidden], before they run."""
        cfg = self.config
        layers = range(cfg.num_layers) if layers is None else layers
        lengths = [len(item.token_ids) for item in batch]
        token_ids = torch.cat([item.token_ids for item in batch])
        positions = torch.cat([item.positions for item in batch])
        # Each RoPE table's cos/sin in the model's dtype (vLLM's cos_sin_cache is), the rotation
        # in float32.
        tables = {table: self._cos_sin(positions, table) for table in cfg.rope_tables}
        if residual is None:
            if layers.start != 0:
                raise ValueError("a run that does not start at layer 0 needs the residual stream")
            x = F.embedding(token_ids, self.weights.embed_tokens)
            if cfg.embedding_scale is not None:
                x = x * torch.tensor(cfg.embedding_scale, dtype=self.dtype)
        else:
            x = torch.cat(list(residual))
        groups = cast(list[tuple[ContextKV, list[int]]], shared_groups(batch))
        adapter_rows = lora_rows([(item.lora, item.positions) for item in batch])
        # Sequences with a shared context go through attend_with_lse and a merge; of those, the
        # ones whose whole `context` precedes their new tokens attend to it apart too (unmasked,
        # uncopied: `_attend`).
        merged = {i for _, members in groups for i in members}
        apart = {i for i in merged if context_precedes(batch[i])}
        # By-position causal masks over (context, new tokens), the same in every layer (None:
        # causal over the new tokens alone); attend_with_lse's additive ones made once here
        # rather than in every layer.
        masks = [causal_mask(item, i in apart) for i, item in enumerate(batch)]
        masks = [
            additive_mask(m) if m is not None and i in merged else m for i, m in enumerate(masks)
        ]
        # Per sliding window, each sequence's mask over all its keys (shared, context, new).
        window_masks = {
            w: [window_mask(item, w) for item in batch] for w in set(cfg.windows) if w is not None
        }
        new_k: list[list[torch.Tensor]] = [[] for _ in batch]
        new_v: list[list[torch.Tensor]] = [[] for _ in batch]
        for index in layers:
            layer = self.weights.layers[index]
            h = self.norm(x, layer.input_norm)
            if on_layer_input is not None:
                on_layer_input(index, h)
            q, k, v = layer.qkv(h)
            for projection, out in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                add_lora(adapter_rows, index, projection, h, out)
            cos, sin = tables[cfg.layers[index].rope]
            q, k = self._heads_rotated(layer, q, k, cos, sin)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            q_seqs = q.split(lengths)
            window = cfg.layers[index].window
            windowed = window is not None
            shared_parts = {} if windowed else self._attend_shared(index, q_seqs, groups)
            outputs = []
            for seq, (q_s, k_s, v_s) in enumerate(
                zip(q_seqs, k.split(lengths), v.split(lengths), strict=True)
            ):
                new_k[seq].append(k_s)
                new_v[seq].append(v_s)
                if window is not None:
                    outputs.append(
                        self._attend_window(
                            index, q_s, k_s, v_s, batch[seq], window_masks[window][seq]
                        )
                    )
                    continue
                outputs.append(
                    self._attend(
                        index,
                        q_s,
                        k_s,
                        v_s,
                        masks[seq],
                        batch[seq].context,
                        shared_parts.get(seq),
                        seq in apart,
                    )
                )
            attn = torch.cat(outputs).reshape(-1, cfg.num_heads * cfg.head_dim)
            o = layer.o(attn)
            add_lora(adapter_rows, index, "o_proj", attn, o)
            if layer.post_attention_norm is not None:
                o = self.norm(o, layer.post_attention_norm)
            x = x + o
            m = layer.mlp(self.norm(x, layer.pre_mlp_norm))
            if layer.post_mlp_norm is not None:
                m = self.norm(m, layer.post_mlp_norm)
            x = x + m
        residuals = x.split(lengths)
        hidden = self.norm(x, self.weights.final_norm).split(lengths)
        return [
            SequenceOutput(hidden[seq], new_k[seq], new_v[seq], residuals[seq])
            for seq in range(len(batch))
        ]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """RoPE for x [n, heads, head_dim] at `positions` [n], as forward rotates layer
        `layer`'s q and k (after QK-norm, where the model has it)."""
        return apply_rope(x, *self._cos_sin(positions, self.config.layers[layer].rope))

    def queries_keys(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s q [n, heads, head_dim] and k [n, kv_heads, head_dim] of its normed
        input h [n, hidden] at `positions` [n], as forward makes them (no adapter)."""
        q, k, _ = self.weights.layers[layer].qkv(h)
        cos, sin = self._cos_sin(positions, self.config.layers[layer].rope)
        return self._heads_rotated(self.weights.layers[layer], q, k, cos, sin)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits (float32) for final hidden states [n, hidden] (soft-capped where
        the model caps them)."""
        logits = F.linear(hidden, self.weights.lm_head).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm of x with `weight`, normalized in float32: Llama's rounds the
        normalized x to x's dtype and multiplies (vLLM's native rms_norm), Gemma's multiplies by
        (1 + weight) in float32 and rounds once."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        if self.config.norm == "gemma":
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return weight * normed.to(x.dtype)

    def _cos_sin(
        self, positions: torch.Tensor, table: RopeTable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(positions, self._inv_freq[table])
        if table.attention_factor != 1.0:
            cos, sin = cos * table.attention_factor, sin * table.attention_factor
        return cos.to(self.dtype), sin.to(self.dtype)

    def _heads_rotated(
        self, layer: Layer, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k viewed per head, QK-normed where the model has it, then RoPE'd."""
        cfg = self.config
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = self.norm(q, layer.q_norm), self.norm(k, layer.k_norm)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _attend_window(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        item: SequenceInput,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """A sliding-window layer's attention: every key the sequence may see (shared, then
        context, then new) under the window's by-position mask."""
        keys, values = [k], [v]
        for part in (item.context, item.shared):
            if part is not None and len(part.positions) > 0:
                part_k, part_v = part.layer(layer_index)
                keys.insert(0, part_k.to(k.dtype))
                values.insert(0, part_v.to(v.dtype))
        return attend(q, torch.cat(keys), torch.cat(values), mask, scale=self._scale)

    def _attend_shared(
        self,
        layer_index: int,
        q_seqs: Sequence[torch.Tensor],
        groups: list[tuple[ContextKV, list[int]]],
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each group's queries against their shared context at once: (out, lse) per member."""
        parts = {}
        for shared, members in groups:
            k, v = shared.layer(layer_index)
            q = torch.cat([q_seqs[m] for m in members])
            out, lse = attend_with_lse(q, k.to(q.dtype), v.to(q.dtype), None, scale=self._scale)
            sizes = [len(q_seqs[m]) for m in members]
            for m, out_m, lse_m in zip(members, out.split(sizes), lse.split(sizes), strict=True):
                parts[m] = (out_m, lse_m)
        return parts

    def _attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        context: ContextKV | None,
        shared_part: tuple[torch.Tensor, torch.Tensor] | None,
        context_apart: bool = False,
    ) -> torch.Tensor:
        """New tokens' attention: to the shared context (its part given), the sequence's own
        context, then each other. A context apart (all before the new tokens, the sequence
        merged anyway) is attended on its own and merged, not copied next to the new keys."""
        if context is not None and len(context.positions) > 0:
            context_k, context_v = context.layer(layer_index)
            if context_apart:
                part = attend_with_lse(
                    q, context_k.to(q.dtype), context_v.to(q.dtype), None, scale=self._scale
                )
                shared_part = part if shared_part is None else merge(*shared_part, *part)
            else:
                k = torch.cat((context_k.to(k.dtype), k))
                v = torch.cat((context_v.to(v.dtype), v))
        if shared_part is None:
            return attend(q, k, v, mask, causal=mask is None, scale=self._scale)
        out, lse = attend_with_lse(q, k, v, mask, causal=mask is None, scale=self._scale)
        return merge(*shared_part, out, lse)[0].to(q.dtype)
