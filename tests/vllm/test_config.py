"""How vLLM is started (kmesh/vllm/config.py), without starting it."""

from kmesh.vllm.config import vllm_server_args


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
