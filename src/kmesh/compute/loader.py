"""Load a Llama-family model folder (config.json + safetensors) into an Executor."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kmesh.compute.config import ModelConfig
from kmesh.compute.embedded import ensure_embedded_model
from kmesh.compute.executor import Executor
from kmesh.compute.fingerprint import model_fingerprint
from kmesh.compute.packaged import PACKAGED_MODELS, ensure_packaged_model
from kmesh.compute.weights import ModelWeights
from kmesh.errors import ModelNotFoundError

# tokenizer_class values AutoTokenizer resolves to TokenizersBackend itself (transformers 5).
_TOKENIZERS_BACKEND = ("TokenizersBackend", "PreTrainedTokenizerFast")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    # SHA-256 over config.json and the weight files: the `model` part of every state key.
    fingerprint: str
    executor: Executor
    # A transformers tokenizer; typed loosely to keep transformers out of import time.
    tokenizer: Any


def resolve_model_dir(model: str | Path | None) -> Path:
    """The folder to load: the embedded default model (None), a packaged model by name
    (kmesh/compute/packaged.py; a name wins over a folder of that name in the working directory,
    which `./NAME` reaches), or the given folder (checked)."""
    if model is None:
        return ensure_embedded_model()
    if isinstance(model, str) and model in PACKAGED_MODELS:
        return ensure_packaged_model(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {str(model)!r} does not exist: give a packaged model's name "
            f"({', '.join(PACKAGED_MODELS)}) or a model folder (config.json and *.safetensors), "
            "or leave --model out to use the embedded default model"
        )
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{str(path)!r} is not a model folder: it needs config.json and *.safetensors files"
        )
    return path


def load_tokenizer(path: str | Path) -> Any:
    """The model folder's tokenizer, the class AutoTokenizer chooses. A Llama folder whose
    tokenizer_config.json names the tokenizers-library class, with no remote code (the embedded
    model's), is loaded through that class: AutoTokenizer picks it too for model type "llama",
    and its import costs 1.5 s of every server start on two cores."""
    folder = Path(path)
    declared = _json(folder / "tokenizer_config.json")
    if (
        declared.get("tokenizer_class") in _TOKENIZERS_BACKEND
        and "auto_map" not in declared
        and _json(folder / "config.json").get("model_type") == "llama"
    ):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _json(file: Path) -> dict[str, Any]:
    return dict(json.loads(file.read_text())) if file.is_file() else {}


def load_model(
    model: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a model folder, or the embedded default model when `model` is None, onto `device`."""
    path = resolve_model_dir(model)
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    weight_files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in weight_files:
        state.update(load_file(file, device=str(device)))
    weights = ModelWeights.from_state_dict(state, config, dtype)
    tokenizer = load_tokenizer(path)
    fingerprint = model_fingerprint(path)
    return LoadedModel(path, config, fingerprint, Executor(config, weights), tokenizer)
