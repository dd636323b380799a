"""The executor, recovery and Master-Mirror restore on a GPU, against the same code on the CPU and
against recomputation on the GPU itself.

Skipped where torch sees no CUDA device (CI, this project's machines). On a machine with one:
`python3 -m pytest --noconftest -o addopts= -p no:cacheprovider tests/test_cuda.py` (it needs
torch and kmesh's compute, kv and recovery modules only). KMESH_TEST_DEVICE=cpu runs it against
the CPU itself, to check the checks.

Models: the tiny random Llama (tests' usual), and random weights in SmolLM2-135M's shape (30
layers, 9 query and 3 KV heads of 64, hidden 576): the embedded model's weights do not travel
to a GPU machine, and exactness does not depend on the weights' values.

Tolerances (float32; the GPU runs matmuls in full float32, TF32 off, torch's default):
- one device against itself (a suffix against its cached prefix, recovery with exact reused KV,
  against one full forward): the same float32 math in a different reduction order, ~1e-6 on
  these O(1) activations; ATOL = 1e-4 still catches a wrong mask, position or KV row (~1e-1);
- the GPU against the CPU: two kernels' float32 rounding, compounded over 30 layers; REL_CROSS
  bounds the max abs difference relative to the CPU values' max abs. Values (V rows, copied)
  must be bit-identical through restore; keys are turned by cos/sin that the two devices round
  differently (1e-6 relative).
- greedy decoding from the GPU's and the CPU's prefill gives the same tokens.
- vLLM's GPU attention pages (kmesh/vllm/split_pages.py) in every KV cache layout, on device
  tensors laid out as vLLM lays them (tests/kv_layouts.py, checked against vLLM where it is
  installed): rows written read back bit for bit and sit where FlashAttention reads them; a page
  crosses host staging (kmesh/vllm/staging.py: pinned memory, a side stream) from a shared-memory
  segment byte for byte; recovery's rows, computed on the device, land in a FlashAttention-layout
  cache unchanged.
"""

import os
from functools import cache
from multiprocessing import shared_memory
from typing import Any

import pytest
import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.executor import DenseKV, Executor, SequenceInput
from kmesh.compute.tiny import SHAPES, random_state_dict
from kmesh.compute.weights import ModelWeights
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror
from kmesh.kv.mirror_restore import restore
from kmesh.recovery.collective import SiblingInput, recover_round
from kmesh.recovery.recover import RecoveryConfig, RegionInput, recover
from kmesh.vllm.split_pages import SplitPages
from kmesh.vllm.staging import Staging
from tests.kv_layouts import LAYOUTS, layer_view_order, layer_views

DEVICE = os.environ.get("KMESH_TEST_DEVICE", "cuda")


def _available(device: str) -> bool:
    return device == "cpu" or (device.startswith("cuda") and torch.cuda.is_available())


pytestmark = pytest.mark.skipif(not _available(DEVICE), reason=f"no {DEVICE} device here")

ATOL = 1e-4
REL_CROSS = 1e-4
# name: (Hugging Face config, weights' standard deviation: ~1/sqrt(hidden) keeps scores O(1))
MODELS: dict[str, tuple[dict[str, Any], float]] = {
    "tiny": (SHAPES["tiny"], 0.1),
    "smollm2_shape": (SHAPES["smollm2_135m"], 0.04),
}


@cache
def executors(model: str) -> tuple[Executor, Executor]:
    """The same random weights on the CPU and on DEVICE (float32)."""
    hf, scale = MODELS[model]
    config = ModelConfig.from_hf(hf)
    state = random_state_dict(0, hf, scale)
    on = {device: {n: w.to(device) for n, w in state.items()} for device in ("cpu", DEVICE)}
    return (
        Executor(config, ModelWeights.from_state_dict(on["cpu"], config, torch.float32)),
        Executor(config, ModelWeights.from_state_dict(on[DEVICE], config, torch.float32)),
    )


def tokens(model: str, n: int, seed: int) -> torch.Tensor:
    vocab = MODELS[model][0]["vocab_size"]
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def forward(executor: Executor, ids: torch.Tensor, start: int = 0, context=None):
    ids = ids.to(executor.device)
    positions = torch.arange(start, start + len(ids), device=executor.device)
    return executor.forward([SequenceInput(ids, positions, context)])[0]


def cross_error(cpu: torch.Tensor, device: torch.Tensor) -> float:
    """Max abs difference of the device's tensor from the CPU's, relative to the CPU's max abs."""
    return float((device.cpu() - cpu).abs().max() / cpu.abs().max().clamp_min(1e-12))


def greedy(executor: Executor, ids: torch.Tensor, steps: int) -> list[int]:
    out = forward(executor, ids)
    k, v = list(out.k), list(out.v)
    generated = []
    for step in range(steps):
        token = int(executor.logits(out.hidden[-1:])[0].argmax())
        generated.append(token)
        at = len(ids) + step
        context = DenseKV(torch.arange(at, device=executor.device), k, v)
        out = forward(executor, torch.tensor([token]), at, context)
        k = [torch.cat(pair) for pair in zip(k, out.k, strict=True)]
        v = [torch.cat(pair) for pair in zip(v, out.v, strict=True)]
    return generated


@pytest.mark.parametrize("model", list(MODELS))
def test_a_prefill_on_the_device_matches_the_cpu_and_decodes_the_same_tokens(model):
    cpu, device = executors(model)
    ids = tokens(model, 300, seed=1)
    on_cpu, on_device = forward(cpu, ids), forward(device, ids)
    assert on_device.hidden.device.type == torch.device(DEVICE).type
    logits_error = cross_error(cpu.logits(on_cpu.hidden), device.logits(on_device.hidden))
    key_error = max(cross_error(a, b) for a, b in zip(on_cpu.k, on_device.k, strict=True))
    assert logits_error < REL_CROSS and key_error < REL_CROSS
    assert greedy(device, ids, 16) == greedy(cpu, ids, 16)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("split", [1, 100, 255])
def test_a_suffix_against_its_cached_prefix_on_the_device_equals_one_forward(model, split):
    _, device = executors(model)
    ids = tokens(model, 256, seed=2)
    whole = forward(device, ids)
    head = forward(device, ids[:split])
    context = DenseKV(torch.arange(split, device=device.device), head.k, head.v)
    tail = forward(device, ids[split:], split, context)
    torch.testing.assert_close(
        device.logits(tail.hidden), device.logits(whole.hidden[split:]), atol=ATOL, rtol=0
    )
    for layer in range(device.config.num_layers):
        torch.testing.assert_close(tail.k[layer], whole.k[layer][split:], atol=ATOL, rtol=0)


def region(executor: Executor, model: str, noise: float) -> tuple[RegionInput, torch.Tensor]:
    """A 96-token region after a 32-token exact prefix; tokens 8..79 reusable, their KV the exact
    KV plus `noise` (a reused segment's drift). Returns the region and the full forward's final
    hidden state (what recovery's last row must give when exact)."""
    ids = tokens(model, 128, seed=3)
    full = forward(executor, ids)
    k, v = torch.stack(full.k), torch.stack(full.v)
    dev = executor.device
    drift = torch.randn(k[:, 32:].shape, generator=torch.Generator().manual_seed(4)) * noise
    reusable = torch.zeros(96, dtype=torch.bool)
    reusable[8:80] = True
    return (
        RegionInput(
            ids[32:].to(dev),
            torch.arange(32, 128, device=dev),
            DenseKV(torch.arange(32, device=dev), list(k[:, :32]), list(v[:, :32])),
            k[:, 32:] + drift.to(dev),
            v[:, 32:] + drift.to(dev),
            reusable.to(dev),
            (torch.arange(96) // 24).to(dev),
            (torch.arange(96) // 8).to(dev),
            keep_reused_outside_selection=False,
        ),
        full.hidden[-1],
    )


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(
    "policy", ["full", "kv_deviation", "first_k", "query", "first_k+query", "random"]
)
def test_recovery_on_the_device_chooses_and_computes_what_the_cpu_does(model, policy):
    cpu, device = executors(model)
    cfg = RecoveryConfig(policy, 0.3, check_layer=1, gate=None)
    (on_cpu,) = recover(cpu, [region(cpu, model, 0.05)[0]], cfg)
    (on_device,) = recover(device, [region(device, model, 0.05)[0]], cfg)
    assert on_device.recomputed.tolist() == on_cpu.recomputed.tolist()
    assert on_device.computed_tokens == pytest.approx(on_cpu.computed_tokens)
    assert cross_error(on_cpu.k, on_device.k) < REL_CROSS
    assert cross_error(on_cpu.v, on_device.v) < REL_CROSS


@pytest.mark.parametrize("model", list(MODELS))
def test_full_recovery_on_the_device_repairs_drifted_kv_to_the_full_forward(model):
    _, device = executors(model)
    drifted, last_hidden = region(device, model, 0.5)
    (out,) = recover(device, [drifted], RecoveryConfig("full", 1.0))
    assert out.last_hidden is not None
    torch.testing.assert_close(
        device.logits(out.last_hidden[None]), device.logits(last_hidden[None]), atol=ATOL, rtol=0
    )
    (kept,) = recover(device, [drifted], RecoveryConfig("none", 0.0))
    assert kept.last_hidden is not None
    drift = device.logits(kept.last_hidden[None]) - device.logits(last_hidden[None])
    assert drift.abs().max() > ATOL


def round_siblings(executor: Executor, model: str) -> list[SiblingInput]:
    """Three siblings after a 16-token common prefix and a private part each, reading three
    round segments (20, 9, 33 tokens) in their own orders, then a 5-token ask."""
    common = tokens(model, 16, seed=5)
    segments = [tokens(model, n, seed=6 + i) for i, n in enumerate((20, 9, 33))]
    siblings = []
    for index, order in enumerate(((0, 1, 2), (2, 0, 1), (1, 2, 0))):
        private = tokens(model, 3 + 4 * index, seed=10 + index)
        start = len(common) + len(private)
        prompt = torch.cat([common, private, *(segments[i] for i in order), tokens(model, 5, 20)])
        head = forward(executor, prompt[:start])
        spans: list[tuple[int, int]] = [(0, 0)] * 3
        at = start
        for i in order:
            spans[i] = (at, at + len(segments[i]))
            at += len(segments[i])
        prefix = DenseKV(torch.arange(start, device=executor.device), head.k, head.v)
        siblings.append(SiblingInput(prompt[start:].to(executor.device), start, prefix, spans))
    return siblings


@pytest.mark.parametrize("model", list(MODELS))
def test_a_round_on_the_device_builds_the_master_and_mirrors_as_the_cpu_does(model):
    cpu, device = executors(model)
    cfg = RecoveryConfig("kv_deviation", 0.25, check_layer=1)
    on_cpu = recover_round(cpu, round_siblings(cpu, model), cfg, 8)
    on_device = recover_round(device, round_siblings(device, model), cfg, 8)
    assert on_device.master.blocks.device.type == torch.device(DEVICE).type
    assert cross_error(on_cpu.master.blocks, on_device.master.blocks) < REL_CROSS
    for a, b in zip(on_cpu.siblings, on_device.siblings, strict=True):
        assert b.recovered.recomputed.tolist() == a.recovered.recomputed.tolist()
        assert cross_error(a.recovered.k, b.recovered.k) < REL_CROSS
        assert [m.diff_index.tolist() for m in b.mirrors] == [
            m.diff_index.tolist() for m in a.mirrors
        ]


@pytest.mark.parametrize("model", list(MODELS))
def test_restore_on_the_device_turns_keys_as_the_cpu_and_copies_values_bit_for_bit(model):
    cpu, _ = executors(model)
    config = cpu.config
    gen = torch.Generator().manual_seed(7)
    shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    segments = [
        MasterSegment(
            torch.randn(shape[0], n, *shape[1:], generator=gen),
            torch.randn(shape[0], n, *shape[1:], generator=gen),
            torch.arange(start, start + n),
        )
        for n, start in ((13, 40), (32, 90), (7, 200))
    ]

    def restored(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        master = Master.build(
            [MasterSegment(*(x.to(device) for x in (s.k, s.v, s.positions))) for s in segments],
            16,
            config,
        )
        mirror = Mirror.of(master, (2, 0, 1), 500)
        k, v = restore(master, mirror, config)
        edited = mirror.with_diff(master, k + 1.0, v - 1.0, torch.tensor([1, 3], device=device))
        return restore(master, edited, config)

    k_cpu, v_cpu = restored("cpu")
    k_device, v_device = restored(DEVICE)
    assert torch.equal(v_device.cpu(), v_cpu)
    assert cross_error(k_cpu, k_device) < 1e-5


PAGE_SHAPE = (3, 6, 2, 16, 2 * 64)  # layers, blocks, KV heads, block size, K|V of head size 64


def split_pages(layout: str, dtype: torch.dtype = torch.float32) -> SplitPages:
    views = layer_views(layout, PAGE_SHAPE, dtype, DEVICE)
    return SplitPages(views, PAGE_SHAPE[3], layer_view_order(layout))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_pages_in_every_layout_hold_rows_where_flash_attention_reads_them(layout, dtype):
    pages = split_pages(layout, dtype)
    layers, _, heads, block, content = PAGE_SHAPE
    block_ids, positions = [5, 0, 3], torch.tensor([0, 1, 15, 16, 31, 40, 47])
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(layers, len(positions), heads, content // 2, generator=gen).to(dtype)
    v = torch.randn(layers, len(positions), heads, content // 2, generator=gen).to(dtype)
    pages.write(block_ids, positions, k, v)
    got_k, got_v = pages.read(block_ids, positions)
    assert got_k.device.type == torch.device(DEVICE).type
    assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)
    for layer, view in enumerate(pages.layers):
        key_cache, _ = view.transpose(1, 2).split(content // 2, dim=-1)  # FlashAttention's
        for i, position in enumerate(positions.tolist()):
            row = key_cache[block_ids[position // block], position % block]
            assert torch.equal(row.cpu(), k[layer, i])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_page_crosses_host_staging_from_a_shared_memory_segment_byte_for_byte(layout):
    source = split_pages(layout)
    for view in source.layers:
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(9)))
    layers = PAGE_SHAPE[0]
    staging = Staging(torch.device(DEVICE))
    data = staging.to_host([source.page(layer, 2) for layer in range(layers)])
    assert data.is_pinned() == (torch.device(DEVICE).type == "cuda")
    segment = shared_memory.SharedMemory(create=True, size=data.numel())
    try:
        segment.buf[:] = data.numpy().tobytes()  # the entry, as the store keeps it
        stored = torch.frombuffer(segment.buf, dtype=torch.uint8)
        target = split_pages(layout)
        staging.to_pages(stored, [target.page(layer, 4) for layer in range(layers)])
        staging.wait()
        if torch.device(DEVICE).type == "cuda":
            torch.cuda.synchronize()
        for src, dst in zip(source.layers, target.layers, strict=True):
            assert torch.equal(src[2], dst[4]) and not dst[2].any()
        back = staging.to_host([target.page(layer, 4) for layer in range(layers)])
        assert torch.equal(back, stored)
        del stored
    finally:
        segment.close()
        segment.unlink()


@pytest.mark.parametrize("model", list(MODELS))
def test_recovered_rows_land_in_a_flash_attention_layout_cache_unchanged(model):
    cpu, device = executors(model)
    config = device.config
    cfg = RecoveryConfig("first_k", 0.3, check_layer=1, gate=None)
    (on_device,) = recover(device, [region(device, model, 0.05)[0]], cfg)
    (on_cpu,) = recover(cpu, [region(cpu, model, 0.05)[0]], cfg)
    shape = (config.num_layers, 8, config.num_kv_heads, 16, 2 * config.head_dim)
    views = layer_views("LBNHC", shape, torch.float32, DEVICE)  # FlashAttention's preference
    pages = SplitPages(views, 16, layer_view_order("LBNHC"))
    block_ids, positions = [7, 2, 5, 0, 1, 6, 3, 4], torch.arange(32, 128)
    pages.write(block_ids, positions, on_device.k, on_device.v)
    got_k, got_v = pages.read(block_ids, positions)
    assert torch.equal(got_k, on_device.k) and torch.equal(got_v, on_device.v)
    assert cross_error(on_cpu.k, got_k) < REL_CROSS and cross_error(on_cpu.v, got_v) < REL_CROSS
