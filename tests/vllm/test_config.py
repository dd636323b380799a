"""How vLLM is started (kmesh/vllm/config.py), without starting it."""

import pytest
from vllm.config import KVTransferConfig

from kmesh.errors import InvalidRequestError
from kmesh.serve.vllm_backend import VLLMBackend
from kmesh.vllm.config import extra_count, kv_transfer_config, vllm_engine_kwargs, vllm_server_args


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
