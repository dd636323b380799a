"""The vLLM side of tests/vllm/test_connector.py, run as its own process (vLLM spawns workers, so
this needs a main guard): `python tests/vllm/connector_job.py OUT_DIR`. Writes OUT_DIR/result.json.

One engine with KMeshConnector, a store and LoRA enabled, then vanilla vLLM with the same
settings and no connector, on real text: a 512-token trunk (the start of argparse's source)
with different suffixes, and two unrelated prompts.
"""

import inspect
import json
import sys
from pathlib import Path
from typing import Any

TRUNK_TOKENS = 512
MAX_TOKENS = 16


def make_adapter(folder: Path, seed: int) -> None:
    """A random rank-8 LoRA on q_proj/v_proj of the embedded model, in PEFT's file format."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for module, out in (("q_proj", 576), ("v_proj", 192)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(8, 576, generator=gen) * 0.15
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, 8, generator=gen) * 0.15
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none"}
    config |= {"target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def prompts(tokenizer: Any) -> dict[str, list[int]]:
    import argparse

    trunk = tokenizer(inspect.getsource(argparse))["input_ids"][:TRUNK_TOKENS]
    texts = {
        "a": "\n\n# Question: what does the parser above do with unknown options?\n# Answer:",
        "b": "\n\n# Summary of this module in one sentence:",
        "c": "\n\nclass Extra(ArgumentParser):\n    def",
    }
    out = {k: trunk + tokenizer(v)["input_ids"] for k, v in texts.items()}
    # The trunk's halves swapped: stored segment KV reused at other positions (recovery).
    half = TRUNK_TOKENS // 2
    out["swapped"] = trunk[half:] + trunk[:half] + tokenizer(texts["a"])["input_ids"]
    out["short"] = tokenizer("The capital of France is")["input_ids"]
    out["other"] = tokenizer("def fibonacci(n):\n    ")["input_ids"]
    return out


def with_connector(store: str, lora: dict, options: dict) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kmesh.vllm.config import vllm_engine_kwargs

    llm = LLM(**vllm_engine_kwargs(store=store, **options))
    named = prompts(llm.get_tokenizer())
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    def run(
        name: str,
        salt: str | None = None,
        adapter: str | None = None,
        kmesh: dict | None = None,
        reset: bool = True,
    ) -> dict:
        prompt: dict[str, Any] = {"prompt_token_ids": named[name]}
        if salt is not None:
            prompt["cache_salt"] = salt
        request = None if adapter is None else lora[adapter]
        params = greedy
        if kmesh is not None:
            params = greedy.clone()
            params.extra_args = {"kv_transfer_params": {"kmesh": kmesh}}
        out = llm.generate([prompt], params, lora_request=request, use_tqdm=False)[0]
        if reset:
            llm.reset_prefix_cache()
        return {"ids": list(out.outputs[0].token_ids), **out.kv_transfer_params["kmesh"]}

    batch = llm.generate([{"prompt_token_ids": p} for p in named.values()], greedy)
    result: dict[str, Any] = {
        "batch": {
            name: {"ids": list(o.outputs[0].token_ids), **o.kv_transfer_params["kmesh"]}
            for name, o in zip(named, batch, strict=True)
        }
    }
    llm.reset_prefix_cache()
    result["restored"] = run("a")
    llm.reset_prefix_cache(reset_connector=True)  # the connector's page tails go too
    result["restored_without_tails"] = run("a")
    result["salt"] = [run("a", salt="A"), run("a", salt="B"), run("a", salt="A")]
    result["lora"] = [run("a", adapter="x"), run("a", adapter="y"), run("a", adapter="x")]
    full = {"recovery": {"policy": "full"}}
    result["recovery_full"] = {name: run(name, kmesh=full) for name in ("a", "c", "short")}
    # Half the trunk from vLLM's prefix cache (read back from its pages), the rest recovered.
    named["half"] = named["a"][: TRUNK_TOKENS // 2]
    run("half", reset=False)
    result["recovery_after_local_hit"] = run("a", kmesh=full)
    result |= approximate(run, named)
    llm.llm_engine.engine_core.shutdown()
    return result


def approximate(run: Any, named: dict[str, list[int]]) -> dict[str, Any]:
    """Approximate recovery (stored segment KV reused at other positions) and what keeps it apart
    from exact requests: its salt, and the gate's fallback to vLLM's prefill."""
    half = TRUNK_TOKENS // 2
    trunk, question = named["a"][:TRUNK_TOKENS], named["a"][TRUNK_TOKENS:]

    def kmesh(order: list[str], **recovery: Any) -> dict:
        parts = {"h1": trunk[:half], "h2": trunk[half:]}
        segments = [{"token_ids": parts[n], "role": "shared", "id": n} for n in order]
        segments.append({"token_ids": question, "role": "instruction"})
        return {"segments": segments, "recovery": recovery}

    salt = "kmesh-approx:job"
    out: dict[str, Any] = {}
    # The first reader computes both halves and stores them (its own KV: exact).
    out["first_reader"] = run("a", salt=salt, kmesh=kmesh(["h1", "h2"], policy="none"))
    # The gate at 0: any deviation sends the claimed blocks back to vLLM's prefill. (Run before
    # the next request publishes its swapped transcript: a transcript restored from the store is
    # served under its salt as vLLM's prefix cache is, without a gate.)
    gated = kmesh(["h2", "h1"], policy="none", gate=0.0)
    out["gated"] = run("swapped", salt=salt, kmesh=gated)
    # Reused swapped, nothing recomputed: approximate; its blocks stay in vLLM's prefix cache.
    none = kmesh(["h2", "h1"], policy="none", gate=None)
    out["approximate"] = run("swapped", salt=salt, kmesh=none, reset=False)
    out["exact_after"] = run("swapped", reset=False)  # no salt: must not hit those blocks
    out["other_salt_after"] = run("swapped", salt="kmesh-approx:other", reset=False)
    out["same_salt_after"] = run("swapped", salt=salt)  # asked for it: served
    # Approximate without an approximate salt: refused, computed exactly.
    out["refused"] = run("swapped", kmesh=none)
    # Quality targets under an approximate salt of their own: exact, and greedy, which no
    # calibration meets on the embedded model: both served as ordinary requests, saying so.
    for target in ("exact", "greedy"):
        ask = kmesh(["h2", "h1"], quality=target)
        out[f"quality_{target}"] = run("swapped", salt="kmesh-approx:quality", kmesh=ask)
    out |= kept_output(run, named)
    return out


def kept_output(run: Any, named: dict[str, list[int]]) -> dict[str, Any]:
    """An author keeps its generated tokens' KV; a later reader's segment that wraps them (a
    header before) reuses it without anyone having computed it as a prompt."""
    salt = "kmesh-approx:kept"
    author = run("short", salt=salt, kmesh={"keep_output": True})
    header = named["other"]
    named["reader"] = named["short"] + header + author["ids"] + named["short"]
    segments = [
        {"token_ids": named["short"], "role": "private"},
        {"token_ids": header + author["ids"], "role": "shared", "id": "said"},
        {"token_ids": named["short"], "role": "instruction"},
    ]
    reader = {"segments": segments, "recovery": {"policy": "none", "gate": None}}
    return {"kept_author": author, "kept_reader": run("reader", salt=salt, kmesh=reader)}


def vanilla(lora: dict, options: dict) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kmesh.vllm.config import vllm_engine_kwargs

    llm = LLM(**vllm_engine_kwargs(connector=False, **options))
    named = prompts(llm.get_tokenizer())
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in named.values()], greedy)
    out = llm.generate([{"prompt_token_ids": named["a"]}], greedy, lora_request=lora["x"])
    return {
        "vanilla": {n: list(o.outputs[0].token_ids) for n, o in zip(named, outs, strict=True)},
        "vanilla_lora_x": list(out[0].outputs[0].token_ids),
    }


def main(out_dir: Path) -> None:
    from vllm.lora.request import LoRARequest

    from kmesh.store.process import start_store

    lora = {}
    for i, name in enumerate(("x", "y"), start=1):
        make_adapter(out_dir / f"lora-{name}", seed=i)
        lora[name] = LoRARequest(name, i, str(out_dir / f"lora-{name}"))
    options = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_model_len": 4096}
    store = start_store(out_dir, capacity="2G")
    try:
        result = with_connector(store.socket, lora, options)
    finally:
        store.stop()
    result |= vanilla(lora, options)
    (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
