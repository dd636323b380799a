"""Prompt log-probabilities (SamplingParams.prompt_logprobs k), as vLLM gives them.

Entry j of a sequence's `prompt_logprobs` covers token j of its request's own prompt
(`Request.prompt_ids`; for a fork, the branch's tokens, which follow the parent's): the
distribution of that token given every token before it, as {token id: natural-log probability}
for the k most likely tokens and the prompt token itself (k entries when it is among them, else
k + 1). Log-probabilities are the log-softmax of the float32 logits, soft-capped as
`Executor.logits` does, before any penalty or temperature.

An entry comes from the logits of the row before it, and only from rows this request computes:
it stays None at position 0 and where that row's KV came from elsewhere (the prefix cache, the
store, recovery, a fork's parent). NOTE: a fork's first own token is the exception: its
distribution is the parent's held next-token logits, exact, so it is given (`take_held`). Filled
entries are never cleared: a sequence preempted and readmitted keeps those of the rows its own
blocks then give back from the cache, and sets the recomputed ones again.
"""

from collections.abc import Callable

import torch

from kmesh.engine.sequence import Sequence

# Rows turned into logits at once: bounds the [rows, vocab] float32 block a long prompt needs.
ROWS_PER_CHUNK = 256


def collect(
    seq: Sequence,
    start: int,
    hidden: torch.Tensor,
    logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Fill the entries the rows [start, start + len(hidden)) a step computed give, from their
    final hidden states and `logits` (the executor's); nothing when the request asks for none."""
    if seq.prompt_logprobs is None:
        return
    offset = seq.num_prompt - len(seq.prompt_logprobs)  # where the request's own prompt starts
    first = max(start, offset - 1)
    end = min(start + len(hidden), seq.num_prompt - 1)
    for row in range(first, end, ROWS_PER_CHUNK):
        rows = slice(row - start, min(row + ROWS_PER_CHUNK, end) - start)
        _fill(seq, row, logits(hidden[rows]))


def take_held(seq: Sequence, parent: Sequence) -> None:
    """A fork's first own token's entry, from its retained parent's held next-token logits."""
    if seq.prompt_logprobs:
        assert parent.held_logits is not None
        _fill(seq, len(parent.token_ids) - 1, parent.held_logits[None])


def _fill(seq: Sequence, first_row: int, logits: torch.Tensor) -> None:
    """Set the entries that float32 logits [n, vocab] of rows first_row.. give (row r gives the
    distribution of token r + 1)."""
    assert seq.prompt_logprobs is not None and seq.request.params is not None
    k = seq.request.params.prompt_logprobs
    assert k is not None
    offset = seq.num_prompt - len(seq.prompt_logprobs)
    next_ids = seq.token_ids[first_row + 1 : first_row + 1 + len(logits)]
    logprobs = torch.log_softmax(logits, dim=-1)
    own = logprobs.gather(1, torch.tensor(next_ids, device=logits.device)[:, None])[:, 0]
    values, ids = torch.topk(logprobs, k)
    rows = zip(next_ids, own.tolist(), ids.tolist(), values.tolist(), strict=True)
    for i, (token, own_value, top_ids, top_values) in enumerate(rows):
        entry = dict(zip(top_ids, top_values, strict=True))
        entry[token] = own_value
        seq.prompt_logprobs[first_row + 1 - offset + i] = entry
