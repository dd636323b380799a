"""What `kmesh bench capacity` counts beyond the runs themselves (bench/capacity/run.py says what is
measured): a token's KV bytes, a dense transcript's, what an unlimited prefix cache would
compute, and the largest agent count within a bound."""

from collections.abc import Sequence
from typing import Any

VLLM_PAGE = 32  # vLLM's page in tokens (kmesh/vllm/config.py::DEFAULT_BLOCK_SIZE)


def token_bytes(model: str | None) -> int:
    """KV bytes of one token (all layers, K and V) of the model folder (the embedded model when
    None) in the dtype vLLM's engines and the reference executor run it in, read from its
    config.json alone: a budget is checked before anything loads."""
    import json

    from kmesh.compute.config import ModelConfig
    from kmesh.compute.loader import resolve_model_dir
    from kmesh.vllm.config import DEFAULT_DTYPE

    hf = json.loads((resolve_model_dir(model) / "config.json").read_text())
    return ModelConfig.from_hf(hf).kv_bytes_per_token(DEFAULT_DTYPE)


def dense_transcript_bytes(rounds: Sequence[Sequence[Any]], per_token: int) -> float:
    """Mean KV bytes of the members' transcripts after the last round (the last prompt minus
    its instruction), dense."""
    last = rounds[-1]
    held = [len(t.prompt.token_ids) - len(t.prompt.segments[-1].token_ids) for t in last]
    return per_token * sum(held) / len(held)


def ideal_prefix_cache(rounds: Sequence[Sequence[Any]]) -> list[int]:
    """Per round, what a prefix cache of unlimited size computes, prompts one after another:
    each prompt minus its longest prefix of whole pages an earlier prompt (of any agent or
    round) had, at least its last token. A lower bound: vLLM batches a round's prompts, and
    those in one step do not hit each other's pages."""
    seen: set[tuple[int, ...]] = set()
    computed = []
    for turns in rounds:
        total = 0
        for turn in turns:
            tokens = turn.prompt.token_ids
            hit = 0
            while hit + VLLM_PAGE < len(tokens) and tokens[: hit + VLLM_PAGE] in seen:
                hit += VLLM_PAGE
            total += len(tokens) - hit
            seen.update(tokens[:end] for end in range(VLLM_PAGE, len(tokens) + 1, VLLM_PAGE))
        computed.append(total)
    return computed


def max_agents(strategy: dict[str, Any], bound: str, limit: float) -> int | None:
    """The largest agent count up to which every run's rounds compute within `limit` x
    `bound`."""
    best = None
    for run in strategy.get("runs", []):
        within = all(
            c <= limit * b
            for c, b in zip(run["computed_tokens_per_round"], run[bound], strict=True)
        )
        if not within:
            break
        best = run["agents"]
    return best
