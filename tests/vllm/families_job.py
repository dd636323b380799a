"""The vLLM side of tests/vllm/test_families_vllm.py, run as its own process (vLLM spawns workers,
so this needs a main guard): `python tests/vllm/families_job.py OUT_DIR FAMILY=FOLDER ...`.
Writes OUT_DIR/result.json: per family, what one engine with KMeshConnector, KMeshWorker and a
store did on that family's tiny random model (tests/model_families.py), in float32.

The families' engines run one after another in this process (one vLLM import for all), each
engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the job can read the KV pages a
request leaves in vLLM's cache: the scheduler-side connector's `request_finished` is wrapped to
read the finished request's prompt rows back from the worker's pages right then
(kmesh/vllm/pages.py). A family whose engine refuses to start records the refusal instead.

Per family, on random token ids (the embedded tokenizer's vocabulary):
- `plain`: every prompt once under a cache_salt of its own and without a `kmesh` object. vLLM
  mixes the salt into the first block's hash, the store keys and the page tails are per salt, so
  nothing is reused: vLLM's kernels compute every row (each result's stats say so), which is
  plain vLLM's computation in this very engine (the connector only reads pages after the step).
- `b0`..`b2`: a family of three branches over one trunk (TRUNK tokens: two whole 32-token pages
  and 6 rows of a third), the first alone until its prompt is computed, then the others beside
  it (as vLLM serves n > 1): they reuse its whole pages (vLLM's prefix cache) and the trunk's
  rows of its partial page (a page tail).
- `extend`: the first branch's prompt and output, then more tokens: the first branch's kept tail
  (kept as it finished, while the other branches still ran) gives the rows past its last whole
  page.
- `after_finish`: `extend`'s prompt and output, then more tokens, sent once `extend` has finished
  and the engine has stopped: the tail it claims is the one vLLM's next allocation takes back.
- `restored`: the second branch again after `reset_prefix_cache(reset_connector=True)`: the
  trunk's whole pages come from the store, byte for byte.
- `pages`: for each KMesh run, the largest difference between the rows [0, prompt) KMesh's run
  left in vLLM's cache and the rows plain vLLM computed for the same prompt.
- `logits`: KMesh's executor on vLLM's loaded modules (kmesh/vllm/model_bridge.py) against vLLM's
  own log-probabilities of a prompt's next token (logprobs=-1, float32): the largest difference.
- `refusals`: the bridge on the loaded model with descriptions wrong in one field each (layer
  count, a layer's window or RoPE table, the attention scale, QK-norm, sandwich norms, the norm
  style, the embedding scale, the qkv bias): what each raised.
- `context`: the max_model_len vLLM started with (none was given: KMesh's, from the model and
  the KV cache) and the pages vLLM's KV cache was given.
- `council`: a collective round (approximate, under an approximate salt): three siblings read
  the same three outputs in different orders; the first is computed by KMesh's executor, the
  others mirror its KV of the outputs, re-rotated per layer's RoPE table.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the pages are read in-process

TRUNK = 70  # two whole 32-token pages and 6 rows of a third
SUFFIX = 10
EXTRA = 8
MAX_TOKENS = 8
BRANCHES = 3
COUNCIL_SALT = "kmesh-approx:council"


def with_kmesh(greedy: Any, kmesh: dict | None) -> Any:
    """`greedy` (vLLM's SamplingParams) carrying a `kmesh` object to the connector, if any."""
    params = greedy.clone()
    if kmesh is not None:
        params.extra_args = {"kv_transfer_params": {"kmesh": kmesh}}
    return params


def prompt_of(ids: list[int], salt: str | None = None) -> dict[str, Any]:
    """A token prompt, under its own cache_salt when given (plain vLLM's computation)."""
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def tokens(n: int, seed: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 20000, (n,), generator=gen).tolist()


class Recorder:
    """Each finished request's rows [0, prompt), read from the worker's pages when the
    scheduler-side connector sees it finish (that step's forward pass is done; nothing has
    written its freed blocks yet), by prompt."""

    def __init__(self, llm: Any) -> None:
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        finished = connector.request_finished
        pages = get_kv_transfer_group()._worker_side._pages
        self.rows: dict[tuple[int, ...], Any] = {}

        def request_finished(request: Any, block_ids: Any) -> Any:
            ids = (
                block_ids[0] if block_ids and isinstance(block_ids[0], list | tuple) else block_ids
            )
            k, v = pages.read(list(ids), torch.arange(request.num_prompt_tokens))
            self.rows[tuple(request.prompt_token_ids)] = (k.clone(), v.clone())
            return finished(request, block_ids)

        connector.request_finished = request_finished


def page_diff(a: Any, b: Any) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def executor_logprobs(worker: Any, folder: str, ids: list[int]) -> Any:
    """Run in the worker (collective_rpc): KMesh's executor on the loaded model, the prompt's
    next-token log-probabilities."""
    import torch

    from kmesh.compute.config import ModelConfig
    from kmesh.compute.executor import SequenceInput
    from kmesh.vllm.model_bridge import executor_of_vllm_model

    config = ModelConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    executor = executor_of_vllm_model(worker.model_runner.get_model(), config)
    ids_t = torch.tensor(ids)
    [out] = executor.forward([SequenceInput(ids_t, torch.arange(len(ids)))])
    return torch.log_softmax(executor.logits(out.hidden[-1:]), dim=-1)[0]


def refusals(worker: Any, folder: str) -> dict[str, str]:
    """Run in the worker (collective_rpc): the bridge on the loaded model with descriptions that
    differ from it in one field each, and what each raised."""
    from dataclasses import replace

    from kmesh.compute.config import ModelConfig
    from kmesh.vllm.model_bridge import executor_of_vllm_model

    config = ModelConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    first, tables = config.layers[0], config.rope_tables
    wrong_window = 7 if first.window is None else None
    halved = tuple(f / 2 for f in tables[0].inv_freq)
    other_table = tables[-1] if len(tables) > 1 else replace(tables[0], inv_freq=halved)
    wrong = {
        "layers": replace(config, layers=config.layers[1:], num_layers=config.num_layers - 1),
        "window": replace(config, layers=(replace(first, window=wrong_window), *config.layers[1:])),
        "rope": replace(config, layers=(replace(first, rope=other_table), *config.layers[1:])),
        "attention_scale": replace(config, attention_scale=config.attention_scale * 2),
        "qk_norm": replace(config, qk_norm=not config.qk_norm),
        "sandwich_norms": replace(config, sandwich_norms=not config.sandwich_norms),
        "norm": replace(config, norm="llama" if config.norm == "gemma" else "gemma"),
        "embedding_scale": replace(config, embedding_scale=None if config.embedding_scale else 2.0),
        "qkv_bias": replace(config, qkv_bias=not config.qkv_bias),
    }
    raised = {}
    model = worker.model_runner.get_model()
    for field, description in wrong.items():
        try:
            executor_of_vllm_model(model, description)
            raised[field] = ""
        except Exception as error:
            raised[field] = f"{type(error).__name__}: {error}"
    return raised


def family(name: str, folder: str, out_dir: Path) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kmesh.bench.vllm_logits import first_token_logits, first_token_params
    from kmesh.store.process import start_store
    from kmesh.vllm.config import vllm_engine_kwargs

    store = start_store(out_dir, capacity="256M")
    result: dict[str, Any] = {}
    try:
        started = time.monotonic()
        try:
            # No max_model_len: the context comes from the model, bounded by the KV cache.
            kwargs = vllm_engine_kwargs(folder, store=store.socket, kv_cache_bytes=64 << 20)
            llm = LLM(**kwargs, max_logprobs=-1)
        except Exception as error:  # a refusal before or at start: its message is the result
            refused = f"{type(error).__name__}: {error}"
            return {"refused": refused, "start_s": round(time.monotonic() - started, 1)}
        result["start_s"] = round(time.monotonic() - started, 1)
        core = llm.llm_engine.engine_core.engine_core
        result["context"] = {
            "max_model_len": llm.llm_engine.model_config.max_model_len,
            "asked": kwargs["max_model_len"],
            "num_blocks": core.scheduler.kv_cache_config.num_blocks,
            "block_size": kwargs["block_size"],
        }
        recorder = Recorder(llm)
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

        def params(kmesh: dict | None) -> Any:
            return with_kmesh(greedy, kmesh)

        def outcome(ids: list[int], out: Any) -> dict:
            got = {"ids": list(out.outputs[0].token_ids), **out.kv_transfer_params["kmesh"]}
            return got | {"rows": recorder.rows.pop(tuple(ids))}

        def run(ids: list[int], salt: str | None = None) -> dict:
            return outcome(ids, llm.generate([prompt_of(ids, salt)], greedy, use_tqdm=False)[0])

        trunk = tokens(TRUNK, 1)
        branches = [trunk + tokens(SUFFIX, 10 + b) for b in range(BRANCHES)]
        plain = {f"b{b}": run(p, salt=f"plain:b{b}") for b, p in enumerate(branches)}
        extend = branches[0] + plain["b0"]["ids"] + tokens(EXTRA, 20)
        plain["extend"] = run(extend, salt="plain:extend")
        after = extend + plain["extend"]["ids"] + tokens(EXTRA, 21)
        plain["after_finish"] = run(after, salt="plain:after_finish")

        kmesh = fork(llm, trunk, branches, params, outcome)
        kmesh["extend"] = run(extend)  # the first branch's kept tail, past its prompt
        kmesh["after_finish"] = run(after)  # sent once `extend` has finished: its tail
        llm.reset_prefix_cache(reset_connector=True)  # vLLM's pages and the kept tails go
        kmesh["restored"] = run(branches[1])
        pages = {
            name: page_diff(got["rows"], plain["b1" if name == "restored" else name]["rows"])
            for name, got in kmesh.items()
        }
        result |= {"plain": plain, "kmesh": kmesh, "pages": pages}

        logit_prompt = branches[2] + tokens(EXTRA, 30)
        vllm_out = llm.generate(
            [{"prompt_token_ids": logit_prompt, "cache_salt": "logits"}],
            first_token_params(),
            use_tqdm=False,
        )[0]
        [ours] = llm.collective_rpc(executor_logprobs, args=(folder, logit_prompt))
        theirs = first_token_logits(vllm_out, len(ours))
        result["logits"] = {
            "max_diff": float((ours - theirs).abs().max()),
            "same_argmax": int(ours.argmax()) == int(theirs.argmax()),
        }
        [result["refusals"]] = llm.collective_rpc(refusals, args=(folder,))
        result |= council(llm, greedy)
        result["total_s"] = round(time.monotonic() - started, 1)
        llm.llm_engine.engine_core.shutdown()
    finally:
        store.stop()
    for runs in (result.get("plain", {}), result.get("kmesh", {})):
        for got in runs.values():
            got.pop("rows")
    return result


def fork(llm: Any, trunk: list[int], branches: list[list[int]], params: Any, outcome: Any) -> dict:
    """The branches as one family: the first alone for one step (its prompt computed), then the
    others beside it, as vLLM serves n > 1 (kmesh/vllm/tail_claims.py)."""
    engine = llm.llm_engine

    def add(b: int) -> None:
        segments = [
            {"token_ids": trunk, "role": "shared", "id": "trunk"},
            {"token_ids": branches[b][len(trunk) :], "role": "private"},
        ]
        spec = {"family": "fork", "branches": len(branches), "segments": segments}
        engine.add_request(f"b{b}", {"prompt_token_ids": branches[b]}, params(spec))

    add(0)
    outs: dict[str, Any] = {}
    first = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        if first:
            for b in range(1, len(branches)):
                add(b)
            first = False
    return {f"b{b}": outcome(branches[b], outs[f"b{b}"]) for b in range(len(branches))}


def council(llm: Any, greedy: Any) -> dict[str, Any]:
    """One collective round of three siblings (module docstring), and the first sibling's
    prompt computed by plain vLLM (its own salt)."""
    system, outputs = tokens(40, 40), [tokens(20, 50 + j) for j in range(3)]
    ids = [f"out-0-{j}" for j in range(3)]
    prompts, kmesh = [], []
    for a in range(3):
        order = [(a + j) % 3 for j in range(3)]
        segments = [
            {"token_ids": system, "role": "shared", "id": "system"},
            {"token_ids": tokens(5, 60 + a), "role": "private"},
            *({"token_ids": outputs[j], "role": "shared", "id": ids[j]} for j in order),
            {"token_ids": tokens(6, 70 + a), "role": "instruction"},
        ]
        prompts.append([t for s in segments for t in s["token_ids"]])
        recovery = {"policy": "kv_deviation", "ratio": 0.0, "gate": None}
        recovery["round"] = {"id": "r1", "segments": ids}
        kmesh.append({"family": "council", "segments": segments, "recovery": recovery})
    params = [with_kmesh(greedy, spec) for spec in kmesh]
    requests = [prompt_of(p, COUNCIL_SALT) for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    siblings = [
        {"ids": list(o.outputs[0].token_ids), **o.kv_transfer_params["kmesh"]} for o in outs
    ]
    first = llm.generate([prompt_of(prompts[0], "plain:council")], greedy, use_tqdm=False)[0]
    return {"council": siblings, "council_plain_first": list(first.outputs[0].token_ids)}


def main(out_dir: Path, specs: list[str]) -> None:
    result = {}
    for spec in specs:
        name, _, folder = spec.partition("=")
        (out_dir / name).mkdir()
        result[name] = family(name, folder, out_dir / name)
    (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
