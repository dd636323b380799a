"""Activated LoRA adapters inside vLLM, which refuses them (docs/design/vllm-integration.md,
section 10).

An activated adapter (peft's `alora_invocation_tokens`, kmesh/compute/lora.py) applies from the
last occurrence of its invocation sequence in the prompt on, and nowhere without one; every token
before is the base model's. vLLM loads such an adapter only as a plain LoRA, applied to every
token it computes. So KMeshConnector serves it the activated way:
- `vllm_adapter_dir` makes the folder vLLM loads: the adapter's weights, its config without
  `alora_invocation_tokens`, and ACTIVATION_FILE naming the invocation sequence;
- `activated_lora_request` names the request's adapter `<name>@from=<start>`; for a request under
  such a folder and name, the connector claims every row before `start` and fills it with
  base-model KV (whole blocks from the store under base-model keys, the rest computed by KMesh's
  executor on vLLM's base layers); vLLM computes from `start` on under the adapter, which is
  Activated LoRA's semantics, generated tokens included.

Why the start is in the name: vLLM's own prefix cache files a LoRA request's blocks under the
adapter's name and path and the tokens, not under where the adapter started. With the start in
the name, every block vLLM files under `<name>@from=<s>` has base rows before s and adapter rows
from s, whichever request computed it, because the connector honours the named start (even where
the invocation's last occurrence is elsewhere: the stats then say so). A request under an
activated folder whose name carries no start is left to vLLM, which applies the adapter to every
token (a plain LoRA; its stats say so), and its blocks are filed under a name no activated request
uses.
"""

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kmesh.compute.lora import invocation_starts
from kmesh.errors import InvalidRequestError

VLLM_FOLDER = "vllm"  # inside the activated adapter's folder
ACTIVATION_FILE = "kmesh_activation.json"
_INVOCATION = "alora_invocation_tokens"


def vllm_adapter_dir(folder: str | Path) -> Path:
    """The folder to give vLLM's LoRARequest for the peft adapter in `folder`: the folder itself
    for a plain adapter; for an activated one its `vllm/` sibling, made on first use."""
    folder = Path(folder).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise InvalidRequestError(f"{str(folder)!r} has no adapter_config.json: not a peft adapter")
    config = json.loads(config_file.read_text())
    invocation = config.pop(_INVOCATION, None)
    if not invocation:
        return folder
    target = folder / VLLM_FOLDER
    if (target / ACTIVATION_FILE).is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".vllm-", dir=folder))
    try:
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(folder / "adapter_model.safetensors", staging / "adapter_model.safetensors")
        activation = {"invocation_tokens": [int(t) for t in invocation], "source": str(folder)}
        (staging / ACTIVATION_FILE).write_text(json.dumps(activation, indent=2) + "\n")
        try:
            os.rename(staging, target)  # atomic: a concurrent maker's folder wins intact
        except OSError:
            if not (target / ACTIVATION_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=64)
def invocation_of(lora_path: str) -> tuple[int, ...] | None:
    """The invocation sequence of the vLLM adapter folder at `lora_path`, or None for a plain
    adapter (a folder without ACTIVATION_FILE)."""
    file = Path(lora_path).expanduser() / ACTIVATION_FILE
    if not file.is_file():
        return None
    return tuple(int(t) for t in json.loads(file.read_text())["invocation_tokens"])


START_TAG = "@from="


def activated_lora_request(
    name: str, lora_int_id: int, folder: str | Path, prompt: Sequence[int]
) -> Any:
    """vLLM's LoRARequest for a prompt under the adapter in `folder` (a peft folder): for an
    activated adapter named with its start in this prompt, or None where it applies nowhere
    (the base model serves the prompt); a plain adapter as it is."""
    from vllm.lora.request import LoRARequest

    path = vllm_adapter_dir(folder)
    invocation = invocation_of(str(path))
    if invocation is None:
        return LoRARequest(name, lora_int_id, str(path))
    starts = invocation_starts(invocation, prompt)
    if not starts:
        return None
    return LoRARequest(f"{name}{START_TAG}{starts[-1]}", lora_int_id, str(path))


@dataclass(frozen=True, slots=True)
class Activation:
    """How KMeshConnector serves a LoRA request: activated from `start` (rows before it are
    base-model KV), or as vLLM does (start None); `note` is what its stats should say."""

    start: int | None
    note: str | None = None


def activation_of(lora_name: str, lora_path: str, prompt: Sequence[int]) -> Activation | None:
    """The activation of a request under the vLLM adapter `lora_name` at `lora_path`; None for
    a plain adapter."""
    invocation = invocation_of(lora_path)
    if invocation is None:
        return None
    _, tag, named = lora_name.rpartition(START_TAG)
    if not tag or not named.isdigit() or not 0 < int(named) < len(prompt):
        return Activation(
            None,
            f"adapter {lora_name!r} is activated, but its name carries no start within the "
            f"prompt ('<name>{START_TAG}<start>', kmesh.vllm.activated.activated_lora_request): "
            "vLLM applied it to every token (a plain LoRA)",
        )
    start = int(named)
    starts = invocation_starts(invocation, prompt)
    last = starts[-1] if starts else None
    if last == start:
        return Activation(start)
    return Activation(
        start,
        f"the adapter applied from token {start}, as its name says, but the invocation "
        f"sequence's last occurrence in the prompt is at {last}",
    )
