"""How vLLM is started (kmesh/vllm/config.py), without starting it."""

import pytest
from vllm.config import KVTransferConfig

from kmesh.errors import InvalidRequestError
from kmesh.serve.vllm_backend import VLLMBackend
from kmesh.vllm.config import (
    cpu_thread_binding,
    extra_count,
    kv_transfer_config,
    vllm_engine_kwargs,
    vllm_server_args,
)


def test_engine_kwargs_become_vllm_server_flags():
    kwargs = {"model": "/m", "enforce_eager": True, "enable_prefix_caching": False, "seed": 0}
    kwargs |= {"kv_transfer_config": {"kv_connector": "KMeshConnector"}, "served_model_name": None}
    assert vllm_server_args(kwargs) == [
        "--model",
        "/m",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--kv-transfer-config",
        '{"kv_connector": "KMeshConnector"}',
    ]


def test_the_dtype_reaches_vllm_from_kmesh_serve_and_an_unknown_one_is_refused():
    assert VLLMBackend().max_model_len > 0  # the embedded model, nothing started
    assert VLLMBackend()._engine_kwargs["dtype"] == "float32"
    assert VLLMBackend(dtype="bfloat16")._engine_kwargs["dtype"] == "bfloat16"
    args = vllm_server_args(vllm_engine_kwargs(connector=False, dtype="bfloat16"))
    assert args[args.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(InvalidRequestError, match="float32, bfloat16, got 'float16'"):
        vllm_engine_kwargs(dtype="float16")


def test_the_recovery_budget_reaches_the_connector_only_when_given():
    assert "recovery_bytes" not in kv_transfer_config(None)["kv_connector_extra_config"]
    extra = kv_transfer_config("/s.sock", 1 << 27)["kv_connector_extra_config"]
    assert extra == {"store": "/s.sock", "recovery_bytes": 1 << 27}


def test_the_heap_reserve_reaches_the_connector_from_kmesh_serve_only_when_given():
    assert "heap_reserve_bytes" not in kv_transfer_config(None)["kv_connector_extra_config"]
    transfer = VLLMBackend(heap_reserve_bytes=0)._engine_kwargs["kv_transfer_config"]
    assert transfer["kv_connector_extra_config"]["heap_reserve_bytes"] == 0
    reserve = KVTransferConfig(**transfer)
    assert extra_count(reserve, "heap_reserve_bytes", 1) == 0


def test_a_count_in_the_connectors_extra_config_is_read_or_refused_by_name():
    def transfer(**extra):
        return KVTransferConfig(**{**kv_transfer_config(None), "kv_connector_extra_config": extra})

    assert extra_count(transfer(), "prefault_blocks", 7) == 7
    assert extra_count(transfer(prefault_blocks="12"), "prefault_blocks", 7) == 12
    assert extra_count(transfer(prefault_blocks=0), "prefault_blocks", 7) == 0
    for bad in ("many", -1, 2.5, True):
        with pytest.raises(ValueError, match="'prefault_blocks' must be a whole number >= 0"):
            extra_count(transfer(prefault_blocks=bad), "prefault_blocks", 7)


def test_the_tensor_parallel_size_reaches_vllm_from_kmesh_serve_with_a_thread_binding(
    family_folder,
):
    assert "tensor_parallel_size" not in vllm_engine_kwargs()
    backend = VLLMBackend(family_folder("qwen2"), tensor_parallel_size=2)  # 4 heads, 2 KV heads
    assert backend._engine_kwargs["tensor_parallel_size"] == 2
    assert backend._binding is not None and backend._binding.count("|") == 1
    assert cpu_thread_binding(2, cores=2) == "0|1"
    assert cpu_thread_binding(2, cores=5) == "0,1|2,3"


def test_a_size_the_model_cannot_split_or_the_cores_cannot_hold_is_refused_in_one_line():
    with pytest.raises(InvalidRequestError, match="9 attention heads and 3 KV heads") as raised:
        vllm_engine_kwargs(tensor_parallel_size=2)  # the embedded SmolLM2-135M
    assert "\n" not in str(raised.value)
    with pytest.raises(InvalidRequestError, match="need a core each; this process may use 2"):
        cpu_thread_binding(3, cores=2)
    with pytest.raises(InvalidRequestError, match="must be 1 or more"):
        vllm_engine_kwargs(tensor_parallel_size=0)


def test_a_kv_head_fewer_than_the_workers_is_copied_to_each_of_them(family_folder):
    kwargs = vllm_engine_kwargs(family_folder("gemma3"), tensor_parallel_size=2)  # 1 KV head
    assert kwargs["tensor_parallel_size"] == 2
