"""The connector's two halves without a vLLM engine: the scheduler side against a real store
with stand-in vLLM requests, the worker side against stand-in KV cache tensors."""

import functools
import json
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import ValidationError

from kmesh.recovery import quality
from kmesh.recovery.jobs import RecoveryJob, RecoveryReport
from kmesh.recovery.quality import Calibration
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.state.request_meta import KMeshParams
from kmesh.store import StoreClient
from kmesh.store.segments import write_segment
from kmesh.vllm import store_side
from kmesh.vllm.activated import ACTIVATION_FILE
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import KMeshConnectorMetadata, LoadBlock, SaveBlock
from kmesh.vllm.metrics import KMeshConnectorStats, KMeshPromMetrics, finished_counts
from kmesh.vllm.recovery_support import recovery_unavailable
from kmesh.vllm.scheduler_side import SchedulerSide
from kmesh.vllm.worker_side import WorkerSide
from tests.store.helpers import wait_until
from tests.vllm.helpers import cpu_attention

BLOCK = 4
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PAGE_SHAPE = (2, BLOCK, 8)  # kv heads, block size, 2 * head size
LAYOUT = BlockLayout(LAYERS, BLOCK, int(np.prod(PAGE_SHAPE)) * 4, torch.float32, "cpu")
PROMPT = list(range(100, 111))  # 11 tokens: 2 full blocks, both before the last token


# A step that scheduled no request (loads and recoveries still go out).
NOTHING_SCHEDULED = SimpleNamespace(
    scheduled_new_reqs=[],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    num_scheduled_tokens={},
)


def request(request_id: str, prompt=PROMPT, salt=None, lora=None, kmesh=None, lora_path="/a"):
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
        cache_salt=salt,
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora, lora_path=lora_path),
        kv_transfer_params=None if kmesh is None else {"kmesh": kmesh},
        output_token_ids=[1, 2],
        all_token_ids=[*prompt, 1, 2],
        num_computed_tokens=len(prompt),  # finished as its prompt was computed
    )


def side(store) -> SchedulerSide:
    scheduler = SchedulerSide(store.socket, LAYOUT, "tiny-model")
    scheduler.bind_block_ids(lambda request_id: ([7, 8, 9, 10, 11, 12],))
    return scheduler


def finish(scheduler: SchedulerSide, req, block_ids=(3, 4, 5)) -> dict:
    """vLLM finishes the request: its stats (its blocks are freed at once)."""
    delay_free, stats = scheduler.request_finished(req, list(block_ids))
    assert not delay_free
    return stats


def compute(scheduler: SchedulerSide, req, tokens: int) -> None:
    """vLLM computes `tokens` of the request; the worker copies the saved blocks; the scheduler
    commits them."""
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: tokens},
    )
    meta = scheduler.build_connector_meta(output)
    saved = {}
    for save in meta.saves:
        fill = bytes([save.block_id]) * LAYOUT.block_bytes
        saved[(save.tenant, save.key)] = write_segment(
            save.segment, save.key, LAYOUT.block_bytes, scheduler.meta_bytes, [fill]
        )
    scheduler.update_connector_output(saved)


def test_the_first_engine_computes_and_publishes_the_next_restores(store):
    first, second = side(store), side(store)
    req = request("a")
    assert first.get_num_new_matched_tokens(req, 0) == (0, False)
    compute(first, req, len(PROMPT))
    assert finish(first, req)["computed_tokens"] == len(PROMPT)

    other = request("b")
    assert second.get_num_new_matched_tokens(other, 0) == (2 * BLOCK, False)
    second.update_state_after_alloc(other, SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],)), 8)
    meta = second.build_connector_meta(NOTHING_SCHEDULED)
    assert [load.block_id for load in meta.loads] == [3, 4]
    stats = finish(second, other)
    assert stats == {
        "prompt_tokens": 11,
        "reused_tokens": 0,
        "restored_tokens": 8,
        "recovered_tokens": 0,
        "computed_tokens": 3,
        "family": None,
    }


def test_an_engine_readies_spare_segments_at_start_and_publishes_into_them(store):
    scheduler = SchedulerSide(store.socket, LAYOUT, "tiny-model", prefault_blocks=3)
    scheduler.bind_block_ids(lambda request_id: ([7, 8, 9, 10, 11, 12],))
    client = scheduler.store.policy.client(None)
    assert client.stats()["spares"] == 3
    req = request("a")
    scheduler.get_num_new_matched_tokens(req, 0)  # leads both blocks
    compute(scheduler, req, len(PROMPT))  # and publishes them
    assert client.stats()["spares"] == 1 and client.stats()["published"] == 2


def test_a_request_waits_while_another_engine_computes_its_blocks(store):
    first, second = side(store), side(store)
    req = request("a")
    first.get_num_new_matched_tokens(req, 0)  # claims both blocks
    assert second.get_num_new_matched_tokens(request("b"), 0) == (None, False)
    compute(first, req, len(PROMPT))
    assert second.get_num_new_matched_tokens(request("b"), 0) == (2 * BLOCK, False)


def test_a_leader_that_finishes_without_computing_hands_its_claims_over(store):
    first, second = side(store), side(store)
    req = request("a")
    first.get_num_new_matched_tokens(req, 0)
    finish(first, req)  # e.g. aborted before it was scheduled
    assert second.get_num_new_matched_tokens(request("b"), 0) == (0, False)  # now leads
    assert len(second.store.led("b")) == 2


@pytest.mark.parametrize(
    "variant", [{"salt": "B"}, {"lora": "x"}], ids=["another cache_salt", "a LoRA adapter"]
)
def test_state_never_crosses_salts_or_adapters(store, variant):
    first, second = side(store), side(store)
    req = request("a")
    first.get_num_new_matched_tokens(req, 0)
    compute(first, req, len(PROMPT))
    assert second.get_num_new_matched_tokens(request("b", **variant), 0) == (0, False)
    assert len(second.store.led("b")) == 2  # it computes (and leads) its own blocks


# 21 tokens whose invocation sequence [110, 111] starts at 10: two whole base blocks before it.
ACTIVATED_PROMPT = list(range(100, 121))
ACTIVATION_START = 10


@pytest.fixture
def activated_folder(tmp_path) -> str:
    """A vLLM adapter folder of an activated adapter (as vllm_adapter_dir makes it)."""
    (tmp_path / ACTIVATION_FILE).write_text(json.dumps({"invocation_tokens": [110, 111]}))
    return str(tmp_path)


def activated(request_id: str, folder: str, name: str = "x"):
    return request(
        request_id, ACTIVATED_PROMPT, lora=f"{name}@from={ACTIVATION_START}", lora_path=folder
    )


def allocate(scheduler: SchedulerSide, req, claimed: int, block_ids=(3, 4, 5, 6, 7, 8)):
    scheduler.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: (list(block_ids),)), claimed
    )
    return scheduler.build_connector_meta(NOTHING_SCHEDULED)


def test_an_activated_request_loads_published_base_blocks_and_fills_the_rest_to_its_start(
    store, activated_folder
):
    first, second = side(store), side(store)
    base = request("a", ACTIVATED_PROMPT)
    first.get_num_new_matched_tokens(base, 0)
    compute(first, base, len(ACTIVATED_PROMPT))  # the base model publishes its blocks
    req = activated("b", activated_folder)
    assert second.get_num_new_matched_tokens(req, 0) == (ACTIVATION_START, False)
    meta = allocate(second, req, ACTIVATION_START)
    assert [load.block_id for load in meta.loads] == [3, 4]  # both base blocks before the start
    [job] = meta.recoveries
    assert (job.start, job.end, job.spec.policy) == (8, ACTIVATION_START, "full")
    stats = finish(second, req)
    assert (stats["restored_tokens"], stats["recovered_tokens"]) == (8, 2)
    assert stats["computed_tokens"] == len(ACTIVATED_PROMPT) - ACTIVATION_START
    assert stats["activation"] == {"start": ACTIVATION_START}


def test_activated_requests_of_one_engine_fill_the_shared_base_blocks_once(store, activated_folder):
    scheduler = side(store)
    x, y = activated("x1", activated_folder, "x"), activated("y1", activated_folder, "y")
    assert scheduler.get_num_new_matched_tokens(x, 0) == (ACTIVATION_START, False)
    assert len(scheduler.store.led("x1")) == 2  # it computes and publishes the base blocks
    assert scheduler.get_num_new_matched_tokens(y, 0) == (None, False)  # waits a step
    allocate(scheduler, x, ACTIVATION_START)
    compute(scheduler, x, ACTIVATION_START)  # the worker filled them; they are published
    assert scheduler.get_num_new_matched_tokens(y, 0) == (ACTIVATION_START, False)
    meta = allocate(scheduler, y, ACTIVATION_START)
    assert len(meta.loads) == 2 and meta.recoveries[0].start == 8


def test_an_activated_adapter_named_without_its_start_is_left_to_vllm(store, activated_folder):
    first, second = side(store), side(store)
    base = request("a", ACTIVATED_PROMPT)
    first.get_num_new_matched_tokens(base, 0)
    compute(first, base, len(ACTIVATED_PROMPT))
    req = request("b", ACTIVATED_PROMPT, lora="x", lora_path=activated_folder)
    assert second.get_num_new_matched_tokens(req, 0) == (0, False)  # no base block either
    assert "carries no start" in finish(second, req)["activation"]["note"]


def test_a_familys_trunk_is_pinned_until_its_declared_branches_finish(store):
    scheduler = side(store)
    family = {"family": "f", "branches": 2}
    one, two = request("a", kmesh=family), request("b", kmesh=family)
    scheduler.get_num_new_matched_tokens(one, 0)
    compute(scheduler, one, len(PROMPT))
    with StoreClient(store.socket) as client:
        assert client.stats()["pinned"] == 2
        scheduler.get_num_new_matched_tokens(two, 0)
        assert finish(scheduler, one)["family"] == "f"
        assert client.stats()["pinned"] == 2
        finish(scheduler, two)
        assert client.stats()["pinned"] == 0


def test_past_the_open_family_limit_the_oldest_abandoned_family_is_let_go(store, monkeypatch):
    monkeypatch.setattr(store_side, "MAX_OPEN_FAMILIES", 2)
    scheduler = side(store)
    with StoreClient(store.socket) as client:
        for i, prompt in enumerate((PROMPT, list(range(200, 211)), list(range(300, 311)))):
            member = request(f"r{i}", prompt, kmesh={"family": f"f{i}", "branches": 4})
            scheduler.get_num_new_matched_tokens(member, 0)
            compute(scheduler, member, len(prompt))
            finish(scheduler, member)  # 1 of 4 declared branches: the family stays open
        # f0's trunk (2 blocks) was let go when f2 made three open families; f1's and f2's stay.
        assert client.stats()["pinned"] == 4


DECLARED = {"family": "council", "next_use": 5.0, "recovery": {"policy": "full"}}


def published(store, count: int) -> list[bytes]:
    """`count` transcript entries another engine published (unpinned)."""
    keys = [bytes([i]) * 32 for i in range(1, count + 1)]
    with StoreClient(store.socket) as client:
        client.acquire(keys)
        for key in keys:
            client.publish(key, b"rows")
    return keys


def test_a_members_transcript_is_pinned_at_its_next_use_until_its_family_closes(store):
    scheduler = side(store)
    keys = published(store, 3)
    member = request("a", kmesh=DECLARED)
    undeclared = request("b", kmesh={"family": "council", "recovery": {"policy": "full"}})
    for req in (member, undeclared):
        scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.pin_transcripts({"a": tuple(keys[:2]), "b": (keys[2],), "gone": (keys[2],)})
    with StoreClient(store.socket) as client:
        assert client.stats()["pinned"] == 2  # only the member that declared its next use
        finish(scheduler, member)
        assert client.stats()["pinned"] == 2  # the family is open: its next round reads them
        closing = request("c", kmesh={**DECLARED, "close": True})
        scheduler.get_num_new_matched_tokens(closing, 0)
        finish(scheduler, closing)
        assert client.stats()["pinned"] == 0  # closed early: unpinned at once


def test_the_pins_of_an_engine_killed_holding_them_are_released(store):
    keys = published(store, 2)
    # An engine's scheduler side in a process of its own (forked: vLLM is imported already) pins
    # a member's transcript, then is killed.
    said, say = os.pipe()  # engine -> test
    go, told = os.pipe()  # test -> engine
    child = os.fork()
    if child == 0:  # pragma: no cover - the engine process
        scheduler = side(store)
        scheduler.get_num_new_matched_tokens(request("a", kmesh=DECLARED), 0)
        scheduler.pin_transcripts({"a": tuple(keys)})
        os.write(say, b"pinned")
        os.read(go, 1)
        os.kill(os.getpid(), signal.SIGKILL)
    assert os.read(said, 6) == b"pinned"
    with StoreClient(store.socket) as client:
        assert client.stats()["pinned"] == 2
    os.write(told, b"x")
    assert os.waitpid(child, 0)[1] == signal.SIGKILL
    for fd in (said, say, go, told):
        os.close(fd)
    with StoreClient(store.socket) as client:
        wait_until(lambda: client.stats()["pinned"] == 0, 5, "the dead engine's pins let go")


def test_next_use_needs_a_family_and_recovery():
    for kmesh in ({"next_use": 1.0}, {"family": "f", "next_use": 1.0}):
        with pytest.raises(ValidationError, match="'next_use' needs a 'family'"):
            KMeshParams.model_validate(kmesh)


APPROXIMATE = {"recovery": {"policy": "kv_deviation", "ratio": 0.3}}


def test_an_exact_recovery_claims_the_whole_blocks_after_the_local_hit(store):
    scheduler = side(store)
    req = request("a", kmesh={"recovery": {"policy": "full"}})
    # block 1 only: vLLM's kernels compute the partial last block (full is vLLM's computation)
    assert scheduler.get_num_new_matched_tokens(req, BLOCK) == (BLOCK, False)
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],)), 4)
    (job,) = scheduler.build_connector_meta(NOTHING_SCHEDULED).recoveries
    assert (job.start, job.end) == (BLOCK, 2 * BLOCK)
    stats = finish(scheduler, req)
    assert (stats["recovered_tokens"], stats["computed_tokens"]) == (BLOCK, len(PROMPT) - 2 * BLOCK)


def test_an_approximate_recovery_claims_every_row_after_the_local_hit_but_the_last(store):
    scheduler = side(store)
    req = request("a", salt="kmesh-approx:t1", kmesh=APPROXIMATE)
    claim = len(PROMPT) - 1 - BLOCK  # not a whole number of blocks: vLLM computes the last row
    assert scheduler.get_num_new_matched_tokens(req, BLOCK) == (claim, False)
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],))
    scheduler.update_state_after_alloc(req, blocks, claim)
    meta = scheduler.build_connector_meta(NOTHING_SCHEDULED)
    (job,) = meta.recoveries
    end = len(PROMPT) - 1
    assert (job.token_ids, job.block_ids, job.start, job.end) == (PROMPT, [3, 4, 5], BLOCK, end)
    assert meta.loads == meta.saves == []  # recovery does not use the store
    stats = finish(scheduler, req)
    assert (stats["reused_tokens"], stats["recovered_tokens"], stats["computed_tokens"]) == (
        BLOCK,
        claim,
        1,
    )


@pytest.mark.parametrize(
    ("salt", "lora", "claimed"),
    [
        (None, None, 0),  # approximate state under no salt would reach exact requests
        ("tenant-1", None, 0),  # ... or under a tenant's ordinary salt
        ("kmesh-approx:t1", "x", 0),  # executor runs the base model only
        ("kmesh-approx:t1", None, len(PROMPT) - 1),
    ],
)
def test_approximate_recovery_is_served_only_under_an_approximate_salt(store, salt, lora, claimed):
    scheduler = side(store)
    req = request("a", salt=salt, lora=lora, kmesh=APPROXIMATE)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (claimed, False)
    stats = finish(scheduler, req)
    assert ("refused" in stats.get("recovery", {})) == (claimed == 0)


def test_an_engine_without_kmeshs_worker_refuses_recovery_up_front_and_says_why(store, caplog):
    config = SimpleNamespace(
        worker_cls="vllm.v1.worker.cpu_worker.CPUWorker", worker_extension_cls=""
    )
    reason = recovery_unavailable(config, LAYOUT)
    assert reason is not None
    with caplog.at_level("WARNING", logger="kmesh.vllm.scheduler_side"):
        scheduler = SchedulerSide(store.socket, LAYOUT, "tiny-model", reason)
    [warning] = [
        r.getMessage() for r in caplog.records if "recovery is unavailable" in r.getMessage()
    ]
    assert "--worker-cls kmesh.vllm.worker.KMeshWorker" in warning
    req = request("a", salt="kmesh-approx:t1", kmesh=APPROXIMATE)
    assert scheduler.get_num_new_matched_tokens(req, BLOCK) == (0, False)  # vLLM computes it
    assert scheduler.build_connector_meta(NOTHING_SCHEDULED).recoveries == []
    stats = finish(scheduler, req)
    assert stats["recovery"] == {"refused": reason}
    assert (stats["recovered_tokens"], stats["computed_tokens"]) == (0, len(PROMPT) - BLOCK)


def claimed_for_recovery(store, kmesh=APPROXIMATE):
    """A scheduler side whose approximate request has every row but its last claimed for
    recovery (its last block partly)."""
    scheduler = side(store)
    req = request("a", salt="kmesh-approx:t1", kmesh=kmesh)
    claim = len(PROMPT) - 1
    assert scheduler.get_num_new_matched_tokens(req, 0) == (claim, False)
    scheduler.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: ([3, 4, 5],)), claim
    )
    scheduler.build_connector_meta(NOTHING_SCHEDULED)
    return scheduler, req


def test_a_recovery_given_back_by_the_worker_is_computed_by_vllm(store):
    scheduler, req = claimed_for_recovery(store)
    scheduler.load_failed({3, 4, 5})  # the gate (or a failure) gave the claimed blocks back
    stats = finish(scheduler, req)
    assert (stats["recovered_tokens"], stats["computed_tokens"]) == (0, len(PROMPT))


def test_a_report_of_a_request_finished_in_the_same_step_reaches_its_stats(store):
    scheduler, req = claimed_for_recovery(store)
    stats = finish(scheduler, req)  # vLLM finishes it before it passes the reports on
    report = RecoveryReport(5.5, 0.0, 0, 0, 3, 0.02, False)
    scheduler.recovery_reports({"a": report})
    assert stats["recovery"]["computed_tokens"] == 5.5
    assert stats["recovery"]["reused_tokens"] == 3


def test_a_met_quality_target_reports_what_served_it_and_its_same_step_report(store, monkeypatch):
    served = Calibration("name:tiny-model", "request", "r0.3", 0.3, None, 0.1, 0.01, 0.0, 0.5)
    monkeypatch.setattr(quality, "CALIBRATIONS", (served,))
    scheduler, req = claimed_for_recovery(store, {"recovery": {"quality": "kl:0.05"}})
    stats = finish(scheduler, req)
    scheduler.recovery_reports({"a": RecoveryReport(5.5, 0.0, 0, 0, 3, 0.02, False)})
    assert stats["quality"] == {"target": "kl:0.05", "served": "r0.3"}
    assert stats["recovery"]["computed_tokens"] == 5.5


def test_finished_requests_reach_vllms_metrics_once_with_their_recovery_report(store):
    scheduler, req = claimed_for_recovery(store)
    stats = finish(scheduler, req)
    scheduler.recovery_reports({"a": RecoveryReport(5.5, 0.0, 4096, 0, 3, 0.02, False)})
    [taken] = scheduler.take_finished()
    assert taken == {**stats, "completion_tokens": 2}
    assert "completion_tokens" not in stats  # the caller's stats are unchanged
    assert scheduler.take_finished() == []
    data = KMeshConnectorStats(finished_counts([taken])).aggregate(
        KMeshConnectorStats(finished_counts([taken]))
    )
    registry = CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    metrics = KMeshPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    metrics.observe(data.reduce(), 0)
    labels = {"model_name": "m", "engine": "0"}
    value = registry.get_sample_value
    recovered = value("kmesh_tokens_total", {**labels, "kind": "recovered"})
    assert recovered == 2 * stats["recovered_tokens"] == 2 * (len(PROMPT) - 1)
    assert value("kmesh_tokens_total", {**labels, "kind": "generation"}) == 4
    assert value("kmesh_recovery_tokens_total", {**labels, "kind": "computed"}) == 11
    assert value("kmesh_recovery_fallbacks_total", labels) == 0
    assert value("kmesh_round_masters_total", labels) == 2  # it built a master, counted twice


def test_without_a_store_vllm_computes_everything(tmp_path):
    scheduler = SchedulerSide(str(tmp_path / "none.sock"), LAYOUT, "m")
    req = request("a")
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not scheduler.store.available
    assert finish(scheduler, req)["computed_tokens"] == len(PROMPT)


def worker(store, page_shape=PAGE_SHAPE) -> tuple[WorkerSide, list[torch.Tensor]]:
    layers = [torch.randn(6, *page_shape) for _ in LAYERS]
    layout = BlockLayout(LAYERS, BLOCK, int(np.prod(page_shape)) * 4, torch.float32, "cpu")
    side = WorkerSide(store.socket, layout)
    side.register_kv_caches(dict(zip(LAYERS, layers, strict=True)), cpu_attention(LAYERS))
    return side, layers


def test_worker_blocks_round_trip_through_the_store_byte_for_byte(store):
    source, source_layers = worker(store)
    target, target_layers = worker(store)
    key = bytes(32)
    with StoreClient(store.socket) as client:
        assert client.acquire([key]).lead == (key,)
        segment = client.reserve(key, LAYOUT.block_bytes)
        source.save(KMeshConnectorMetadata(saves=[SaveBlock(None, 2, key, segment)]))
        saved = source.take_worker_meta()
        assert saved is not None
        client.commit(key, saved.saved[(None, key)], source.meta_bytes)
        hit = client.acquire([key]).hits[0]
    target.load(KMeshConnectorMetadata(loads=[LoadBlock(None, 5, hit)]))
    assert target.take_load_errors() == set()
    for src, dst in zip(source_layers, target_layers, strict=True):
        assert torch.equal(src[2], dst[5])


def test_worker_abandons_a_block_that_vllm_recomputed_after_a_failed_fill(store):
    side, _ = worker(store)
    spec = RecoverySpec(policy="full")
    job = RecoveryJob("a", PROMPT, [3, 4, 5], BLOCK, 2 * BLOCK, None, [], spec, None)
    side.recover(KMeshConnectorMetadata(recoveries=[job]))  # no model
    key = bytes(32)
    with StoreClient(store.socket) as client:
        client.acquire([key])
        segment = client.reserve(key, LAYOUT.block_bytes)
    side.save(KMeshConnectorMetadata(saves=[SaveBlock(None, 4, key, segment)]))
    saved = side.take_worker_meta()
    assert saved is not None and saved.saved == {(None, key): None}  # not published


def test_worker_reports_an_entry_of_another_layout_as_a_load_error(store):
    target, _ = worker(store)
    key = bytes(32)
    with StoreClient(store.socket) as client:
        client.acquire([key])
        client.publish(key, bytes(LAYOUT.block_bytes), meta={"dtype": "bfloat16"})
        hit = client.acquire([key]).hits[0]
    target.load(KMeshConnectorMetadata(loads=[LoadBlock(None, 5, hit)]))
    assert target.take_load_errors() == {5}


def test_an_entry_stored_at_another_tensor_parallel_size_is_refused_with_its_reason(store, caplog):
    from dataclasses import replace

    from kmesh.store.segments import encode_meta

    two = replace(LAYOUT, page_bytes=LAYOUT.page_bytes // 2, tp_size=2)  # each worker's half
    target, target_layers = worker(store)
    key = bytes(32)
    with StoreClient(store.socket) as client:
        client.acquire([key])
        segment = client.reserve(key, two.block_bytes)
        data = torch.randn(two.block_bytes // 4)
        meta = encode_meta(two.meta)
        crc = write_segment(segment, key, two.block_bytes, meta, [data.numpy().data])
        client.commit(key, crc, meta)
        hit = client.acquire([key]).hits[0]
    before = [layer[5].clone() for layer in target_layers]
    target.load(KMeshConnectorMetadata(loads=[LoadBlock(None, 5, hit)]))
    assert target.take_load_errors() == {5}
    assert all(torch.equal(a, b[5]) for a, b in zip(before, target_layers, strict=True))
    assert "stored at another tensor-parallel size" in caplog.text
    assert "tensor_parallel_size 2 (here 1)" in caplog.text


def test_worker_refuses_a_kv_cache_of_another_dtype_than_the_layout(store):
    side = WorkerSide(store.socket, LAYOUT)
    layers = {name: torch.zeros(6, *PAGE_SHAPE, dtype=torch.bfloat16) for name in LAYERS}
    with pytest.raises(ValueError, match=r"expected cpu:LBHNC of torch\.float32"):
        side.register_kv_caches(layers, cpu_attention(LAYERS))


def test_hits_stay_pinned_until_the_request_that_loads_them_finishes(store):
    first, second = side(store), side(store)
    req = request("a")
    first.get_num_new_matched_tokens(req, 0)
    compute(first, req, len(PROMPT))
    finish(first, req)
    other = request("b")
    second.get_num_new_matched_tokens(other, 0)
    with StoreClient(store.socket) as client:
        assert client.stats()["pinned"] == 2  # not evictable before the worker loads them
        finish(second, other)
        assert client.stats()["pinned"] == 0


def test_worker_without_an_attached_model_gives_claimed_blocks_back_to_vllm(store):
    side, _ = worker(store)
    spec = RecoverySpec(policy="full")
    job = RecoveryJob("a", PROMPT, [3, 4, 5], BLOCK, 2 * BLOCK, None, [], spec, None)
    side.recover(KMeshConnectorMetadata(recoveries=[job]))
    assert side.take_load_errors() == {4}  # block 1 of the request: rows [4, 8)


def finished_generating(request_id: str, output: list[int], **kwargs):
    """A request that generated `output` (every token but the last fed back: computed)."""
    req = request(request_id, **kwargs)
    req.output_token_ids = output
    req.all_token_ids = [*req.prompt_token_ids, *output]
    req.num_computed_tokens = len(req.prompt_token_ids) + len(output) - 1
    return req


def test_a_request_keeping_its_output_holds_its_blocks_until_the_worker_read_its_rows(store):
    scheduler = side(store)
    req = finished_generating("a", [7, 8, 9], kmesh={"keep_output": True})
    scheduler.get_num_new_matched_tokens(req, 0)
    delay_free, stats = scheduler.request_finished(req, [3, 4, 5, 6])
    assert delay_free and stats["kept_output_tokens"] == 2
    (out,) = scheduler.build_connector_meta(NOTHING_SCHEDULED).outputs
    assert (out.request_id, out.token_ids, out.block_ids, out.start) == (
        "a",
        [7, 8],  # the last generated token was never fed back: it has no KV
        [3, 4, 5, 6],
        len(PROMPT),
    )
    assert scheduler.build_connector_meta(NOTHING_SCHEDULED).outputs == []  # sent once


@pytest.mark.parametrize(
    "kwargs",
    [{"kmesh": None}, {"kmesh": {"keep_output": True}, "lora": "x"}],
    ids=["not asked", "LoRA"],
)
def test_an_output_is_not_kept_unless_asked_and_never_under_an_adapter(store, kwargs):
    scheduler = side(store)
    req = finished_generating("a", [7, 8, 9], **kwargs)
    scheduler.get_num_new_matched_tokens(req, 0)
    delay_free, stats = scheduler.request_finished(req, [3, 4, 5, 6])
    assert not delay_free and "kept_output_tokens" not in stats
    assert scheduler.build_connector_meta(NOTHING_SCHEDULED).outputs == []


class _KeptOutputs:
    """Stands in for RequestRecovery (its segment store): records what the worker keeps."""

    def __init__(self) -> None:
        self.kept: list[tuple] = []
        self.segments = self
        # What the worker reads to share state through its store.
        self.executor = SimpleNamespace(config=None)
        self.fingerprint = "f" * 64
        self.shared = None

    def share(self, shared) -> None:
        self.shared = shared

    def keep_output(self, tenant, token_ids, k, v, start) -> None:
        self.kept.append((tenant, token_ids, k, v, start))


def test_the_worker_keeps_a_finished_requests_generated_rows_then_releases_its_blocks(store):
    from kmesh.vllm.cpu_pages import CpuPages
    from kmesh.vllm.metadata import KeepOutput

    side, layers = worker(store)
    out = KeepOutput("a", "kmesh-approx:t", [7, 8], [3, 4, 5, 1], len(PROMPT))
    metadata = KMeshConnectorMetadata(outputs=[out])
    side.keep_outputs(metadata)  # no recovery attached: nothing kept, blocks released anyway
    assert side.take_kept() == {"a"} and side.take_kept() == set()
    kept = _KeptOutputs()
    side.attach_recovery(kept)  # type: ignore[arg-type]
    side.keep_outputs(metadata)
    assert side.take_kept() == {"a"}
    ((tenant, tokens, k, v, start),) = kept.kept
    positions = torch.arange(len(PROMPT), len(PROMPT) + 2)  # rows 11, 12: blocks 5 and 1
    want_k, want_v = CpuPages(layers, BLOCK, list(cpu_attention(LAYERS).values())).read(
        [3, 4, 5, 1], positions
    )
    assert (tenant, tokens, start) == ("kmesh-approx:t", [7, 8], len(PROMPT))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def prompt_step(req) -> SimpleNamespace:
    """A scheduler step that computes the whole prompt of `req`."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: req.num_prompt_tokens},
    )


def tail_side(tmp_path) -> SchedulerSide:
    """A scheduler side without a store (tails are this engine's own)."""
    scheduler = SchedulerSide(str(tmp_path / "none.sock"), LAYOUT, "m")
    scheduler.bind_block_ids(lambda request_id: ([3, 4, 5],))
    scheduler.tails.bind_block_pool(lambda block_id: True)  # every freed block stays free
    return scheduler


def test_a_branch_of_a_computed_prompt_computes_only_its_last_token(tmp_path):
    scheduler = tail_side(tmp_path)
    first = request("first")  # 11 tokens: pages [0, 4), [4, 8) and rows 8, 9, 10 of the third
    assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    (kept,) = scheduler.build_connector_meta(prompt_step(first)).prompt_tails
    assert (kept.block_ids, kept.start, kept.end) == ([3, 4, 5], 8, 11)

    branch = request("branch")
    claimed, _ = scheduler.get_num_new_matched_tokens(branch, 8)
    assert claimed == 2  # rows 8, 9: vLLM computes row 10
    (copy,) = allocate(scheduler, branch, claimed, (6, 7, 8)).tail_copies
    assert (copy.tail_id, copy.block_ids, copy.start, copy.end) == (kept.tail_id, [6, 7, 8], 8, 10)
    stats = finish(scheduler, branch)
    assert (stats["reused_tokens"], stats["computed_tokens"]) == (10, 1)


def test_a_continuation_takes_the_rows_its_parent_generated_past_its_last_page(tmp_path):
    scheduler = tail_side(tmp_path)
    parent = finished_generating("parent", [7, 8, 9])  # rows 0..12 computed (9 never fed)
    scheduler.get_num_new_matched_tokens(parent, 0)
    delay_free, _ = scheduler.request_finished(parent, [3, 4, 5, 6])
    assert not delay_free  # the worker reads rows [12, 13) first thing in the next step
    (kept,) = scheduler.build_connector_meta(NOTHING_SCHEDULED).finished_tails
    assert (kept.block_ids, kept.start, kept.end) == ([3, 4, 5, 6], 12, 13)

    turn = request("turn", prompt=[*PROMPT, 7, 8, 9, 20, 21])
    claimed, _ = scheduler.get_num_new_matched_tokens(turn, 12)
    assert claimed == 1
    allocate(scheduler, turn, claimed, (6, 7, 8, 9))
    assert finish(scheduler, turn)["computed_tokens"] == 3  # 9, 20, 21


@pytest.mark.parametrize(
    "kwargs",
    [{"salt": "B"}, {"lora": "x"}, {"kmesh": {"recovery": {"policy": "kv_deviation"}}}],
    ids=["another cache_salt", "a LoRA adapter", "a recovering request"],
)
def test_no_tail_crosses_salts_or_adapters_or_reaches_a_recovering_request(tmp_path, kwargs):
    scheduler = tail_side(tmp_path)
    first = request("first")
    scheduler.get_num_new_matched_tokens(first, 0)
    scheduler.build_connector_meta(prompt_step(first))
    other = request("other", **kwargs)
    claimed, _ = scheduler.get_num_new_matched_tokens(other, 8)
    assert allocate(scheduler, other, claimed, (6, 7, 8)).tail_copies == []


@pytest.mark.parametrize(
    "kwargs",
    [{"lora": "x"}, {"kmesh": {"recovery": {"policy": "kv_deviation"}}}],
    ids=["a LoRA adapter", "a recovering request (its rows may be approximate)"],
)
def test_adapter_and_recovering_requests_file_no_tails(tmp_path, kwargs):
    scheduler = tail_side(tmp_path)
    req = request("req", **kwargs)
    scheduler.get_num_new_matched_tokens(req, 0)
    assert scheduler.build_connector_meta(prompt_step(req)).prompt_tails == []


def test_a_finished_requests_tail_is_dropped_when_the_next_step_took_its_block(tmp_path):
    scheduler = tail_side(tmp_path)
    scheduler.tails.bind_block_pool(lambda block_id: block_id != 6)  # block 6 allocated again
    parent = finished_generating("parent", [7, 8, 9])  # its last page: rows [12, 13) in block 6
    scheduler.get_num_new_matched_tokens(parent, 0)
    scheduler.request_finished(parent, [3, 4, 5, 6])
    assert scheduler.build_connector_meta(NOTHING_SCHEDULED).finished_tails == []
    turn = request("turn", prompt=[*PROMPT, 7, 8, 9, 20, 21])
    assert scheduler.get_num_new_matched_tokens(turn, 12) == (0, False)


def test_a_tail_the_worker_could_not_copy_is_computed_by_vllm(tmp_path):
    scheduler = tail_side(tmp_path)
    first = request("first")
    scheduler.get_num_new_matched_tokens(first, 0)
    scheduler.build_connector_meta(prompt_step(first))
    branch = request("branch")
    allocate(scheduler, branch, scheduler.get_num_new_matched_tokens(branch, 8)[0], (6, 7, 8))
    scheduler.load_failed({8})  # the block the rows were copied into
    assert finish(scheduler, branch)["computed_tokens"] == 3


def test_the_worker_copies_a_kept_tail_exactly_and_reports_a_missing_one(store):
    from kmesh.vllm.cpu_pages import CpuPages
    from kmesh.vllm.metadata import CopyTail, KeepTail

    side, layers = worker(store, (1, BLOCK, 128))  # a head size vLLM's cache-write op takes
    pages = CpuPages(layers, BLOCK, list(cpu_attention(LAYERS).values()))
    side.keep_tails([KeepTail(0, [3, 4, 5], 8, 11)])
    side.copy_tails([CopyTail(0, [0, 1, 2], 8, 10)])
    want = pages.read([3, 4, 5], torch.arange(8, 10))
    got = pages.read([0, 1, 2], torch.arange(8, 10))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert side.take_load_errors() == set()

    side.drop_tails([0])
    side.copy_tails([CopyTail(0, [0, 1, 2], 8, 10)])
    assert side.take_load_errors() == {2}


def test_the_worker_keeps_no_tail_from_pages_that_failed_to_load(store):
    from kmesh.vllm.metadata import CopyTail, KeepTail

    side, _ = worker(store)
    key = bytes(32)
    with StoreClient(store.socket) as client:  # an entry of another layout: block 5 fails
        client.acquire([key])
        client.publish(key, bytes(LAYOUT.block_bytes), meta={"dtype": "bfloat16"})
        hit = client.acquire([key]).hits[0]
    side.load(KMeshConnectorMetadata(loads=[LoadBlock(None, 5, hit)]))
    side.keep_tails([KeepTail(0, [3, 4, 5], 8, 11)])
    side.copy_tails([CopyTail(0, [0, 1, 2], 8, 10)])
    assert side.take_load_errors() == {5, 2}
