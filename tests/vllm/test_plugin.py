"""The `vllm.general_plugins` entry point makes KMeshConnector known to vLLM by name."""

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
