"""Pick the next token from logits: greedy, or temperature / top-p with a per-request generator."""

import torch

from kmesh.engine.request import SamplingParams


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float]:
    """Return (token id, the model's log-probability of it) for float32 logits of shape [vocab]."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set of top tokens whose mass reaches top_p (always at least one).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])
