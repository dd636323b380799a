"""One generated token at a time: sampling it into a sequence, whether the sequence is done, and
the RequestOutput of a sequence that ended."""

import time
from collections.abc import Callable

import torch

from kmesh.compute.config import ModelConfig
from kmesh.engine.request import RequestOutput
from kmesh.engine.sampler import sample
from kmesh.engine.sequence import Sequence
from kmesh.engine.stop_strings import first_stop


def sample_into(seq: Sequence, logits: torch.Tensor) -> None:
    """Sample the sequence's next token from `logits` and append it (the first one's time is
    the request's time to first token)."""
    params = seq.request.params
    assert params is not None
    prompt = seq.token_ids[: seq.num_prompt]
    token, logprob, top = sample(logits, params, seq.generator, prompt, seq.output_ids)
    seq.append(token, logprob, logits, top)
    if len(seq.output_ids) == 1:
        seq.stats.first_token_seconds = time.perf_counter() - seq.submitted_at


def finish_reason(
    seq: Sequence,
    config: ModelConfig,
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
) -> str | None:
    """ "stop" (a stop token, or a stop string in the output `decode`d), "length" (max_tokens or
    the engine's context, `max_model_len`, reached), or None: the sequence goes on."""
    params = seq.request.params
    assert params is not None
    stop_ids = config.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
    if seq.token_ids[-1] in stop_ids:
        return "stop"
    if params.stop and decode and first_stop(decode(seq.output_ids), params.stop) is not None:
        return "stop"
    if len(seq.output_ids) >= params.max_tokens:
        return "length"
    if len(seq.token_ids) >= max_model_len:
        return "length"
    return None


def request_output(seq: Sequence) -> RequestOutput:
    """The output of a sequence that ended (finished or retained); its stats completed."""
    assert seq.finish_reason is not None
    seq.stats.output_tokens = len(seq.output_ids)
    seq.stats.seconds = time.perf_counter() - seq.submitted_at
    return RequestOutput(
        request_id=seq.request.request_id,
        prompt_ids=tuple(seq.token_ids[: seq.num_prompt]),
        output_ids=tuple(seq.output_ids),
        logprobs=tuple(seq.output_logprobs),
        top_logprobs=tuple(seq.output_top_logprobs),
        finish_reason=seq.finish_reason,
        stats=seq.stats,
        logits=tuple(seq.output_logits) if seq.request.keep_logits else None,
        prompt_logprobs=None if seq.prompt_logprobs is None else tuple(seq.prompt_logprobs),
    )
