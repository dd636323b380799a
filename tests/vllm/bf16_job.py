"""The vLLM side of tests/vllm/test_bf16.py, run as its own process (vLLM spawns workers, so this
needs a main guard): `python tests/vllm/bf16_job.py OUT_DIR`. Writes OUT_DIR/result.json.

One engine with KMeshConnector in bfloat16 (no store: recovery needs none), then vanilla vLLM in
bfloat16 with the same settings and no connector, on real text: a 512-token trunk (the start of
argparse's source) with three suffixes. Recovery with policy `full` runs on each prompt from
scratch (every full block before the last token claimed), and once after a local prefix hit of
half the trunk (the exact prefix then comes back from vLLM's bfloat16 pages). Vanilla runs the
prompts cold in one batch, then each in other ways vLLM itself computes it (alone, and after a
prefix hit of half the trunk): vLLM's own bfloat16 spread on this machine. Each
result holds the greedy token ids, each one's logprob and margin over the runner-up, and
KMeshConnector's stats.
"""

import inspect
import json
import sys
from pathlib import Path
from typing import Any

TRUNK_TOKENS = 512
MAX_TOKENS = 16
OPTIONS = {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_bytes": 256 << 20}
FULL = {"recovery": {"policy": "full"}}
CHECKED = ("b", "c", "d")
HIT = "c"  # recovered after a local prefix hit of half the trunk


def prompts(tokenizer: Any) -> dict[str, list[int]]:
    import argparse

    trunk = tokenizer(inspect.getsource(argparse))["input_ids"][:TRUNK_TOKENS]
    texts = {
        "b": "\n\n# Summary of this module in one sentence:",
        "c": "\n\nclass Extra(ArgumentParser):\n    def",
        "d": "\n\n# The three most important classes defined above are",
    }
    out = {name: trunk + tokenizer(text)["input_ids"] for name, text in texts.items()}
    out["half"] = trunk[: TRUNK_TOKENS // 2]
    return out


def greedy() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)


def generated(output: Any) -> dict[str, Any]:
    """The greedy ids, each one's logprob and its margin over the runner-up (vLLM's logprobs)."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    steps = list(zip(completion.logprobs, ids, strict=True))
    top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step, _ in steps]
    return {
        "ids": ids,
        "logprobs": [step[token].logprob for step, token in steps],
        "margins": [first - second for first, second in top2],
    }


def with_connector() -> dict[str, Any]:
    from vllm import LLM

    from kmesh.vllm.config import vllm_engine_kwargs

    llm = LLM(**vllm_engine_kwargs(**OPTIONS))
    named = prompts(llm.get_tokenizer())

    def run(name: str, kmesh: dict | None = None, reset: bool = True) -> dict[str, Any]:
        params = greedy()
        if kmesh is not None:
            params.extra_args = {"kv_transfer_params": {"kmesh": kmesh}}
        out = llm.generate([{"prompt_token_ids": named[name]}], params, use_tqdm=False)[0]
        if reset:
            llm.reset_prefix_cache()
        return {**generated(out), **out.kv_transfer_params["kmesh"]}

    result: dict[str, Any] = {"full": {name: run(name, FULL) for name in CHECKED}}
    run("half", reset=False)  # half the trunk now sits in vLLM's prefix cache
    result["full_after_local_hit"] = run(HIT, FULL)
    llm.llm_engine.engine_core.shutdown()
    return result


def vanilla() -> dict[str, Any]:
    """Each checked prompt cold, all in one batch (what KMesh is compared with), and vLLM's own
    other ways of computing the same prompts (alone, and after a prefix hit of half the trunk):
    its bfloat16 spread on this machine's kernels."""
    from vllm import LLM

    from kmesh.vllm.config import vllm_engine_kwargs

    llm = LLM(**vllm_engine_kwargs(connector=False, **OPTIONS))
    named = prompts(llm.get_tokenizer())

    def cold(names: tuple[str, ...]) -> dict[str, Any]:
        outs = llm.generate([{"prompt_token_ids": named[n]} for n in names], greedy())
        llm.reset_prefix_cache()
        return {n: generated(o) for n, o in zip(names, outs, strict=True)}

    result: dict[str, Any] = {"vanilla": cold(CHECKED)}
    variants: dict[str, dict[str, Any]] = {"alone": {n: cold((n,))[n] for n in CHECKED}}
    variants["after_hit"] = {}
    for name in CHECKED:  # after a prefix hit of half the trunk
        llm.generate([{"prompt_token_ids": named["half"]}], greedy())
        variants["after_hit"][name] = generated(
            llm.generate([{"prompt_token_ids": named[name]}], greedy())[0]
        )
        llm.reset_prefix_cache()
    result["vanilla_variants"] = variants
    return result


def main(out_dir: Path) -> None:
    result = with_connector() | vanilla()
    (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
