"""Output quality of an approximate prefill measured against the exact one.

Every metric compares a test run with the reference (full recomputation) on the same prompts:
the KL divergence of the next-token distributions at the first generated position, whether
their argmax agrees, and how long the greedy continuations stay identical.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.lora import LoraUse


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || test) of the next-token distributions, per row.

    Inputs are [n, vocab] logits of any float dtype; the divergence is computed in float64 from
    log_softmax and returned as [n] float64, clamped at >= 0 (tiny negative rounding).
    """
    if reference_logits.shape != logits.shape or reference_logits.dim() != 2:
        raise ValueError(
            f"logits must both be [n, vocab] of the same shape, got "
            f"{tuple(reference_logits.shape)} and {tuple(logits.shape)}"
        )
    log_p = torch.log_softmax(reference_logits.to(torch.float64), dim=-1)
    log_q = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def greedy_match(reference: Sequence[int], tokens: Sequence[int]) -> float:
    """Length of the common prefix of two greedy continuations over len(reference).

    1.0 means identical (over the reference's length).
    """
    if not reference:
        raise ValueError("the reference continuation is empty")
    common = 0
    for a, b in zip(reference, tokens, strict=False):
        if a != b:
            break
        common += 1
    return common / len(reference)


@dataclass(frozen=True, slots=True)
class Quality:
    kl_mean: float
    kl_p95: float
    top1_agreement: float
    greedy_match_32: float
    samples: int

    @classmethod
    def measure(
        cls,
        reference_logits: torch.Tensor,
        logits: torch.Tensor,
        reference_greedy: Sequence[Sequence[int]],
        greedy: Sequence[Sequence[int]],
    ) -> "Quality":
        """Quality over n prompts.

        logits are [n, vocab] at the first generated position; the greedy lists are each
        prompt's greedy continuation (normally 32 tokens). top1_agreement is the fraction of rows
        whose argmax agrees, kl_p95 the 95th percentile of the per-row KL (linear interpolation,
        like numpy.percentile), greedy_match_32 the mean greedy_match.
        """
        kl = next_token_kl(reference_logits, logits)  # validates the shapes
        n = kl.shape[0]
        if n < 1:
            raise ValueError("no prompts to measure (n = 0)")
        if len(reference_greedy) != n or len(greedy) != n:
            raise ValueError(
                f"expected {n} greedy continuations each, got {len(reference_greedy)} "
                f"reference and {len(greedy)} test"
            )
        top1 = reference_logits.argmax(dim=-1) == logits.argmax(dim=-1)
        matches = [greedy_match(r, t) for r, t in zip(reference_greedy, greedy, strict=True)]
        return cls(
            kl_mean=kl.mean().item(),
            kl_p95=torch.quantile(kl, 0.95).item(),
            top1_agreement=top1.double().mean().item(),
            greedy_match_32=sum(matches) / n,
            samples=n,
        )

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready: KL to 6 significant digits, fractions to 4 decimals."""
        return {
            "kl_mean": float(f"{self.kl_mean:.6g}"),
            "kl_p95": float(f"{self.kl_p95:.6g}"),
            "top1_agreement": round(self.top1_agreement, 4),
            "greedy_match_32": round(self.greedy_match_32, 4),
            "samples": self.samples,
        }


def greedy_decode(
    executor: Executor,
    contexts: Sequence[DenseKV],
    logits: torch.Tensor,
    steps: int,
    loras: Sequence[LoraUse | None] | None = None,
) -> list[list[int]]:
    """`steps` greedy tokens per sequence, the first from `logits`, each later one computed
    against the sequence's own context (no stop tokens: a fixed-length comparison), under the
    sequence's adapter if `loras` gives one."""
    tokens = [[int(t)] for t in logits.argmax(dim=-1)]
    ks = [list(c.k) for c in contexts]
    vs = [list(c.v) for c in contexts]
    lengths = [len(c.positions) for c in contexts]
    for step in range(steps - 1):
        batch = [
            SequenceInput(
                torch.tensor([tokens[i][-1]]),
                torch.tensor([lengths[i] + step]),
                DenseKV(torch.arange(lengths[i] + step), ks[i], vs[i]),
                lora=None if loras is None else loras[i],
            )
            for i in range(len(contexts))
        ]
        outputs = executor.forward(batch)
        next_ids = executor.logits(torch.cat([o.hidden for o in outputs])).argmax(dim=-1)
        for i, out in enumerate(outputs):
            tokens[i].append(int(next_ids[i]))
            ks[i] = [torch.cat((k, new)) for k, new in zip(ks[i], out.k, strict=True)]
            vs[i] = [torch.cat((v, new)) for v, new in zip(vs[i], out.v, strict=True)]
    return tokens
