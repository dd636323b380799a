"""Recovery claims of the connector's scheduler half: rows after vLLM's local hit that KMesh's
executor fills in the worker half (kmesh/recovery/requests.py) instead of vLLM computing them.

A request asking for recovery (`"recovery": {...}`, kmesh.state.recovery_meta.RecoverySpec) skips
the store's blocks: its rows after the local hit, all but the prompt's last (a claim need not end on
a block boundary; policy full claims whole blocks only), are claimed and filled by the worker half
(from its transcript in the store where published, store/shared/transcripts.py), which reports what
it computed; blocks it could not fill (the quality gate, no model attached) come back as load errors
and vLLM computes them. Recovery is refused (vLLM computes the prompt as usual) for LoRA requests,
and an approximate one without a cache_salt starting with APPROX_SALT_PREFIX, so approximate KV
never enters another request's prefix hits.

A request under an activated adapter named with its start (kmesh/vllm/activated.py) has its rows
before that start claimed and filled with base-model KV (BASE_FILL): its store hits there load,
the executor computes the rest.
"""

from typing import Any

from kmesh.kv.block_pool import blocks_for
from kmesh.recovery.jobs import RecoveryJob
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.vllm.tracked import Tracked

# An activated request's rows before its start: base-model KV, computed in full.
BASE_FILL = RecoverySpec(policy="full")


def recovery_claim(request: Any, spec: RecoverySpec, first: int, block_size: int) -> int:
    """Rows to claim after the local hit (`first` whole blocks): every one but the last
    (whose logits vLLM computes); for policy full whole blocks only, so that vLLM's own
    kernels compute the partial last one: full promises vLLM's computation up to rounding,
    and in bfloat16 KMesh's executor computing those last rows too moved a logprob by 0.125
    nats (tests/vllm/test_bf16.py)."""
    start = first * block_size
    if spec.approximate:
        return max(0, request.num_prompt_tokens - 1 - start)
    return max(0, (request.num_prompt_tokens - 1) // block_size * block_size - start)


def recovery_job(
    request: Any,
    tracked: Tracked,
    block_ids: list[int],
    rows: tuple[int, int],
    spec: RecoverySpec,
    family: str | None,
    block_size: int,
) -> RecoveryJob:
    """The job filling the request's rows [start, end) in the worker; the request counts them
    as recovered (until the worker gives blocks back)."""
    start, end = rows
    spans = [] if spec is BASE_FILL else tracked.spans
    job = RecoveryJob(
        request.request_id,
        list(request.prompt_token_ids),
        list(block_ids),
        start,
        end,
        tracked.tenant,
        spans,
        spec,
        family,
    )
    tracked.recovered_tokens = end - start
    tracked.recovered_block_ids = set(block_ids[start // block_size : blocks_for(end, block_size)])
    return job
