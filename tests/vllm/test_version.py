"""KMesh refuses a vLLM release it was not tested with (src/kmesh/vllm/version.py), comparing
only the release part, and KMeshConnector checks before vLLM constructs anything."""

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kmesh.errors import DependencyError
from kmesh.vllm.connector import KMeshConnector
from kmesh.vllm.version import SUPPORTED_VLLM_VERSIONS, check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32", "v0.32.0"])
def test_a_supported_release_passes_whatever_its_local_suffix(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "0.32.1+cpu", "1.0.0", "unknown"])
def test_an_untested_release_is_refused_in_one_line_naming_the_supported_ones(version):
    with pytest.raises(DependencyError) as refused:
        check_vllm_version(version)
    message = str(refused.value)
    assert "\n" not in message
    assert version in message
    assert all(supported in message for supported in SUPPORTED_VLLM_VERSIONS)


def test_the_installed_vllm_is_supported():
    check_vllm_version(vllm.__version__)


def test_the_connector_refuses_an_untested_vllm_before_anything_else(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    # No config at all: the check comes before vLLM's base class reads one.
    with pytest.raises(DependencyError, match=r"KMesh supports vLLM 0\.32\.0, not .* 0\.33\.0"):
        KMeshConnector(None, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
