"""Requests to vLLM with KMeshConnector from the benches, and the first generated position's
full distribution from an output, as logits for kmesh.bench.quality (vLLM returns
log-probabilities; log_softmax of them is themselves)."""

from typing import Any

import torch


def first_token_params() -> Any:
    """Sampling parameters for one greedy token with the whole vocabulary's logprobs (the engine
    needs `max_logprobs=-1`)."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0, max_tokens=1, logprobs=-1, flat_logprobs=True, detokenize=False
    )


def first_token_logits(output: Any, vocab_size: int) -> torch.Tensor:
    """[vocab_size] log-probabilities of a request's first generated token (-inf where vLLM
    gave none; its padded vocabulary rows past the model's are dropped)."""
    logprobs = output.outputs[0].logprobs
    lo, hi = logprobs.start_indices[0], logprobs.end_indices[0]
    row = torch.full((vocab_size,), float("-inf"))
    ids = torch.tensor(logprobs.token_ids[lo:hi])
    keep = ids < vocab_size
    row[ids[keep]] = torch.tensor(logprobs.logprobs[lo:hi])[keep]
    return row


def generate(llm: Any, requests: list[tuple[dict, dict | None]], params: Any) -> list[Any]:
    """vLLM's outputs of (prompt, kmesh object or None) requests, each with `params` and its
    kmesh object as the connector's kv_transfer_params."""
    per_request = []
    for _, kmesh in requests:
        p = params.clone()
        if kmesh is not None:
            p.extra_args = {"kv_transfer_params": {"kmesh": kmesh}}
        per_request.append(p)
    return list(llm.generate([p for p, _ in requests], per_request, use_tqdm=False))
