"""The `vllm.general_plugins` entry point: vLLM calls `register` in every process it starts, so
`kv_transfer_config={"kv_connector": "KMeshConnector", ...}` works without a module path."""

from kmesh.vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME


def register() -> None:
    # NOTE: no version check here: vLLM calls every installed plugin in every process, and does
    # not catch what one raises, so a refusal here would stop vLLM even for users who never ask
    # for KMeshConnector. KMeshConnector checks the version when it is constructed.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
