"""The vLLM side of tests/vllm/test_tensor_parallel.py, run as its own process (vLLM spawns its
workers: a main guard): `python tests/vllm/tp_job.py OUT_DIR NAME=FOLDER ...`. Writes
OUT_DIR/result.json: per model, what engines with KMeshConnector at tensor_parallel_size=2 on
vLLM's CPU backend (each worker bound to one core: VLLM_CPU_OMP_THREADS_BIND="0|1") did, in
float32, on prompts of English text cut to the token counts of families_job.py (a model with real
weights then writes text, not one token over and over):

- `plain`: each prompt under a cache_salt of its own and without a `kmesh` object (vLLM mixes the
  salt into its first block's hash, and the store keys and page tails are per salt: nothing is
  reused), in the first engine: plain vLLM's computation at the same parallel size.
- `kmesh`: the fork of tests/vllm/families_job.py (three branches over a trunk of two whole pages
  and 6 rows of a third: the first alone, then the others reusing its pages and its page tail, as
  far as their prompts agree: `shared` tokens, the trunk and the questions' common start),
  then `extend` (the first branch's prompt and output, then more: its kept tail), in the same
  engine. Each worker copies its own shard of the heads.
- `restored`: the second branch after the engine's prefix cache and kept tails were dropped
  (`reset_prefix_cache(reset_connector=True)`), or, for the models named after
  `--second-engine`, in a second engine at tensor_parallel_size=2 on the same store once the
  first has stopped: the trunk's whole pages come from the store, each worker loading its shard
  of the entries the first rank wrote.
An entry restored at another parallel size is refused by its meta; tests/vllm/
test_connector_sides.py checks that without an engine.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.vllm.families_job import (
    BRANCHES,
    EXTRA,
    MAX_TOKENS,
    SUFFIX,
    TRUNK,
    fork,
    prompt_of,
    with_kmesh,
)

PARALLEL = 2
TRUNK_TEXT = (
    "The council of the river towns met at dawn in the old mill. Each delegate brought a "
    "proposal for the new bridge: where it should stand, how many lanterns it should carry, "
    "and who would keep the toll. The miller spoke first and argued for the narrow crossing "
    "near the weir, where the banks are stone and the current is slow in summer."
)
QUESTIONS = [
    " Question: which crossing did the miller favour, and why? Answer in one sentence:",
    " Question: what three things did each proposal have to settle? Answer briefly:",
    " Question: where and when did the council meet? Answer in a few words:",
]
MORE = " Then the ferryman stood up and disagreed with all of them, loudly."


def prompts(folder: str) -> tuple[list[int], list[list[int]], list[int]]:
    """The trunk (TRUNK tokens), the branches (trunk + SUFFIX tokens each) and EXTRA more."""
    from kmesh.compute.loader import load_tokenizer

    tokenizer = load_tokenizer(Path(folder))
    trunk = tokenizer(TRUNK_TEXT).input_ids[:TRUNK]
    suffixes = [tokenizer(q, add_special_tokens=False).input_ids[:SUFFIX] for q in QUESTIONS]
    more = tokenizer(MORE, add_special_tokens=False).input_ids[:EXTRA]
    assert len(trunk) == TRUNK and all(len(s) == SUFFIX for s in suffixes) and len(more) == EXTRA
    return trunk, [trunk + suffix for suffix in suffixes[:BRANCHES]], more


def engine(folder: str, store: str) -> Any:
    from vllm import LLM

    from kmesh.vllm.config import vllm_engine_kwargs

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per worker
    kwargs = vllm_engine_kwargs(
        folder,
        store=store,
        max_model_len=1024,
        kv_cache_bytes=64 << 20,
        tensor_parallel_size=PARALLEL,
    )
    return LLM(**kwargs)


def model(folder: str, out_dir: Path, second_engine: bool) -> dict[str, Any]:
    from vllm import SamplingParams

    from kmesh.store.process import start_store

    store = start_store(out_dir, capacity="256M")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    trunk, branches, more = prompts(folder)

    def params(kmesh: dict | None) -> Any:
        return with_kmesh(greedy, kmesh)

    def outcome(ids: list[int], out: Any) -> dict:
        return {"ids": list(out.outputs[0].token_ids), **out.kv_transfer_params["kmesh"]}

    def run(llm: Any, ids: list[int], salt: str | None = None) -> dict:
        return outcome(ids, llm.generate([prompt_of(ids, salt)], greedy, use_tqdm=False)[0])

    def stop(llm: Any) -> None:
        llm.llm_engine.engine_core.shutdown()

    result: dict[str, Any] = {}
    started = time.monotonic()
    try:
        first = engine(folder, store.socket)
        plain = {f"b{b}": run(first, p, salt=f"plain:b{b}") for b, p in enumerate(branches)}
        extend = branches[0] + plain["b0"]["ids"] + more
        plain["extend"] = run(first, extend, salt="plain:extend")
        kmesh = fork(first, trunk, branches, params, outcome)
        kmesh["extend"] = run(first, extend)
        if second_engine:
            stop(first)
            first = engine(folder, store.socket)
        else:
            first.reset_prefix_cache(reset_connector=True)  # vLLM's pages and the kept tails go
        kmesh["restored"] = run(first, branches[1])
        stop(first)
        shared = next(i for i, t in enumerate(zip(*branches, strict=True)) if len(set(t)) > 1)
        result |= {"plain": plain, "kmesh": kmesh, "shared": shared}
    finally:
        store.stop()
    result["total_s"] = round(time.monotonic() - started, 1)
    return result


def main(out_dir: Path, args: list[str]) -> None:
    """`args`: NAME=FOLDER ..., then optionally --second-engine NAME ..."""
    specs, _, second = " ".join(args).partition("--second-engine")
    result = {}
    for spec in specs.split():
        name, _, folder = spec.partition("=")
        (out_dir / name).mkdir()
        result[name] = model(folder, out_dir / name, name in second.split())
    (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
