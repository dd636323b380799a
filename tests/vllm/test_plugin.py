"""The `vllm.general_plugins` entry point makes KMeshConnector known to vLLM by name, and a
connector so configured recomputes what it cannot load."""

from importlib.metadata import entry_points

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kmesh.vllm.config import CONNECTOR_NAME
from kmesh.vllm.connector import KMeshConnector


def test_the_entry_point_registers_the_connector_once():
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kmesh"]
    register = plugin.load()
    register()
    register()  # vLLM loads plugins in every process, sometimes twice: no error
    assert KVConnectorFactory._registry[CONNECTOR_NAME]() is KMeshConnector


def test_a_connector_configured_by_name_recomputes_what_it_cannot_load(caplog):
    from vllm.config import KVTransferConfig

    from kmesh.vllm.connector import recompute_failed_loads

    transfer = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both")
    assert transfer.kv_load_failure_policy == "fail"  # vLLM's default
    with caplog.at_level("WARNING", logger="kmesh.vllm.connector"):
        recompute_failed_loads(transfer)
    assert transfer.kv_load_failure_policy == "recompute"
    assert "kv_load_failure_policy 'fail' would fail a request" in caplog.text
    caplog.clear()
    recompute_failed_loads(transfer)  # already so: nothing said
    assert transfer.kv_load_failure_policy == "recompute" and not caplog.text
