"""Signals a runtime could read off a recovered prompt, beyond the gate's deviation and the top-1
margin (bench/signals/divergence.py fits and scores them against diverging outputs):

- `attention_mass`: how much the prompt's last token attends to reused rows (KV taken as given,
  not computed in this context): its attention weights summed over those rows, averaged over
  heads and layers. Computed by running the last token again over the prompt's other rows,
  with the executor's layer-input hook giving each layer's query, and attending (the
  executor's kernel) to values that are 1 on the reused rows.
- `probe`: the last rows computed both ways. The `rows` rows before the prompt's final
  segment, and that segment, are computed afresh after the rest of the recovered prompt; the
  last token's next-token distribution is compared with the recovered one: KL(probe ||
  recovered), and how far the top-1 margin moved. A state that moves when its last rows are
  recomputed is one whose output may move when more of it is.

Both read the recovered KV k, v [L, n, H, D] of the whole prompt (rows at positions 0..n-1) and
cost one forward pass of 1 and of rows + final-segment tokens.
"""

import torch

from kmesh.bench.quality import next_token_kl
from kmesh.bench.signals.divergence import top1_margin
from kmesh.compute.attention import attend
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.workloads.allgather import AgentTurn

PROBE_ROWS = 16  # rows before the final segment the probe recomputes (one reference block)


def prompt_signals(
    executor: Executor,
    turn: AgentTurn,
    kv: tuple[torch.Tensor, torch.Tensor],
    reused: torch.Tensor,
    logits: torch.Tensor,
) -> dict[str, float]:
    """Both signals of a turn's recovered prompt (kv: its rows, `reused` of them) whose last
    token gave `logits`."""
    token_ids = torch.tensor(turn.prompt.token_ids)
    final_segment = len(turn.prompt.segments[-1].token_ids)
    kl, shift = probe(executor, token_ids, *kv, final_segment, logits)
    mass = attention_mass(executor, token_ids, *kv, reused)
    return {"attention_mass": mass, "probe_kl": kl, "probe_shift": shift}


def attention_mass(
    executor: Executor,
    token_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    reused: torch.Tensor,
) -> float:
    """Mean over layers and heads of the last token's attention weight on the `reused` rows
    ([n] bool) of the prompt."""
    n = len(token_ids)
    cfg = executor.config
    inputs: dict[int, torch.Tensor] = {}
    context = DenseKV(torch.arange(n - 1), list(k[:, : n - 1]), list(v[:, : n - 1]))
    last = SequenceInput(token_ids[n - 1 :], torch.tensor([n - 1]), context)
    executor.forward([last], on_layer_input=lambda layer, h: inputs.__setitem__(layer, h))
    # Attending to values that are 1 on the reused rows and 0 elsewhere gives each head's mass.
    indicator = reused.to(k.dtype)[:, None, None].expand(n, cfg.num_kv_heads, 1)
    position = torch.tensor([n - 1])
    masses = []
    for layer, h in inputs.items():
        q, own_k = executor.queries_keys(layer, h, position)
        keys = torch.cat((k[layer, : n - 1], own_k))  # [n, kv_heads, D]
        scale = cfg.attention_scale
        masses.append(float(attend(q, keys, indicator, None, scale=scale).mean()))
    return sum(masses) / len(masses)


def probe(
    executor: Executor,
    token_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    final_segment: int,
    logits: torch.Tensor,
    rows: int = PROBE_ROWS,
) -> tuple[float, float]:
    """(KL(probe || recovered), |probe margin - recovered margin|) of the last position, for the
    prompt whose last `final_segment` tokens are its final segment and whose recovered last
    token gave `logits` [vocab]."""
    n = len(token_ids)
    start = max(1, n - final_segment - rows)
    context = DenseKV(torch.arange(start), list(k[:, :start]), list(v[:, :start]))
    out = executor.forward([SequenceInput(token_ids[start:], torch.arange(start, n), context)])
    probed = executor.logits(out[0].hidden[-1:])[0]
    kl = float(next_token_kl(probed[None], logits[None])[0])
    return kl, abs(top1_margin(probed) - top1_margin(logits))
