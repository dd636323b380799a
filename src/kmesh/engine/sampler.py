"""Pick the next token from logits: greedy, or temperature then top-k, min-p and top-p with a
per-request generator, after the sampling penalties vLLM applies (the same definitions, so both
engines agree):
- repetition_penalty r (CTRL's): a token seen in the prompt or the output has its logit divided by
  r where positive, multiplied by r where negative;
- frequency_penalty f and presence_penalty p: a token the output holds c times loses f * c + p
  (p once it appears at all).
A temperature under GREEDY_BELOW is greedy, as vLLM's. Extreme values never fail: a logit pushed
to +inf (a tiny penalty or temperature) counts as the largest finite one, NaN as -inf, and when
every token is ruled out the most likely penalized one is taken.
"""

from collections.abc import Sequence

import torch

from kmesh.engine.request import SamplingParams, TopLogprobs

# vLLM's _SAMPLING_EPS: a smaller temperature samples greedily.
GREEDY_BELOW = 1e-5


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> tuple[int, float, TopLogprobs]:
    """Return (token id, the model's log-probability of it, the params.top_logprobs most likely
    tokens' log-probabilities) for float32 logits of shape [vocab]; the penalties see the
    sequence's prompt and output so far. Log-probabilities are the raw logits' (before
    penalties, temperature and top-p), as vLLM's default `raw_logprobs`."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top: TopLogprobs = ()
    if params.top_logprobs:
        values, ids = torch.topk(logprobs, params.top_logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    logits = penalized(logits, params, prompt_ids, output_ids)
    if params.temperature < GREEDY_BELOW:
        token = int(torch.argmax(_finite(logits)))
        return token, float(logprobs[token]), top
    logits = _finite(logits / params.temperature)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[0])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set of top tokens whose mass reaches top_p (always at least one).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        token = int(torch.argmax(logits))  # every token ruled out: the most likely
        return token, float(logprobs[token]), top
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token]), top


def _finite(logits: torch.Tensor) -> torch.Tensor:
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def penalized(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> torch.Tensor:
    """The logits after the penalties (module docstring); the same tensor when all are neutral."""
    r, f, p = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if r == 1.0 and f == 0.0 and p == 0.0:
        return logits
    logits = logits.clone()
    vocab = logits.shape[0]
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)
    if r != 1.0:
        seen = counts > 0
        seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        logits = torch.where(seen & (logits > 0), logits / r, logits)
        logits = torch.where(seen & (logits < 0), logits * r, logits)
    return logits - f * counts.to(logits.dtype) - p * (counts > 0).to(logits.dtype)
