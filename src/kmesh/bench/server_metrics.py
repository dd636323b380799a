"""What a bench reads from a server's `/metrics` (kmesh serve, or vLLM's own OpenAI server).

Counters so far: prompt and computed tokens; for KMesh also reused, restored and recovered
tokens, recovery fallbacks and round masters built. computed = rows the engine's prefill computed
+ rows KMesh's executor recomputed while recovering (token-equivalents); vLLM: prompt minus its
cached tokens. `kv_usage`: the share of the engine's KV cache in use now (a gauge).
"""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def server_counters(url: str) -> dict[str, float]:
    """The server's counters and its KV cache usage now (module docstring)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = sample.labels.get("kind")
            name = f"{sample.name}{{{kind}}}" if kind else sample.name
            sums[name] = sums.get(name, 0.0) + sample.value
    if "vllm:prompt_tokens_total" in sums:
        prompt = sums["vllm:prompt_tokens_total"]
        return {
            "prompt": prompt,
            "computed": prompt - sums["vllm:prompt_tokens_cached_total"],
            "kv_usage": sums.get("vllm:kv_cache_usage_perc", 0.0),
        }
    counts = {
        kind: sums.get(f"kmesh_tokens_total{{{kind}}}", 0.0)
        for kind in ("prompt", "reused", "restored", "recovered")
    }
    counts["computed"] = sums.get("kmesh_tokens_total{computed}", 0.0) + sums.get(
        "kmesh_recovery_tokens_total{computed}", 0.0
    )
    counts["fallbacks"] = sums.get("kmesh_recovery_fallbacks_total", 0.0)
    counts["masters"] = sums.get("kmesh_round_masters_total", 0.0)
    counts["kv_usage"] = sums.get("kmesh_engine_kv_usage", 0.0)
    return counts
