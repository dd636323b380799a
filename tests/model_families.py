"""Tiny random models of every family KMesh's executor runs, built from transformers config
objects in the tests (nothing downloaded): Llama 2 and 3 (and RoPE `linear`), Qwen 2.5 (qkv bias,
RoPE `yarn`), Qwen 3 (QK-norm), Mistral (a sliding window on every layer) and Gemma 3 text
(interleaved sliding and full layers, per-layer-type RoPE thetas, (1 + w) norms, sandwich norms,
query_pre_attn_scalar).

The shapes vary what users' models vary, so that no number in the code can hide behind one shape
(tests/compute/test_families.py checks the spread): contexts of 2048, 4096 and 32768 positions,
head dims from 32 to 256 (each one of vLLM 0.32's CPU attention head sizes), GQA ratios from 1
(multi-head) to 4, and vocabularies of the tokenizer's 49152 or padded past it (as Qwen's
embeddings are). All use the embedded model's tokenizer and its bos/eos. Sliding windows (16) are
shorter than the tests' prompts (48+ tokens), and the RoPE scalings change the frequencies at
these head dims (tests/compute/test_families.py checks both). Weights are
re-drawn at std 0.1: at transformers' 0.02 the logits are nearly flat and greedy decoding
repeats one token, which would compare nothing.
"""

import functools
import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 49152  # the embedded SmolLM2 tokenizer's
PADDED_VOCAB_SIZE = VOCAB_SIZE + 128  # embedding rows no token reaches
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
STD = 0.1
SLIDING_WINDOW = 16

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": EOS_TOKEN_ID,
    "rms_norm_eps": 1e-6,
}


def _config(
    architectures: str = "LlamaForCausalLM", positions: int = 2048, **fields: Any
) -> dict[str, Any]:
    return {
        "architectures": [architectures],
        **_COMMON,
        "max_position_embeddings": positions,
        **fields,
    }


def _gemma3(**fields: Any) -> dict[str, Any]:
    return _config(
        "Gemma3ForCausalLM",
        32768,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=192,
        sliding_window=SLIDING_WINDOW,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        **fields,
    )


FAMILIES: dict[str, PreTrainedConfig] = {
    # Llama 2: plain RoPE.
    "llama2": LlamaConfig(
        **_config(
            positions=4096,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        )
    ),
    # Llama 3.x: rope_type llama3; original_max_position_embeddings 128 puts the high-frequency
    # cut at wavelength 32 and the low-frequency one at 128, so of head_dim 32's 16 frequencies
    # (theta 5e5) 2 are kept, 2 smoothed between and 12 divided by 8.
    "llama3": LlamaConfig(
        **_config(
            positions=32768,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            tie_word_embeddings=False,
        )
    ),
    # Llama with RoPE linear (every frequency halved) and biases on every projection.
    "llama_linear": LlamaConfig(
        **_config(
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        )
    ),
    # Qwen 2.5: biases on q, k and v (not o, not the MLP); head_dim = hidden / heads.
    "qwen2": Qwen2Config(
        **_config(
            "Qwen2ForCausalLM",
            4096,
            vocab_size=PADDED_VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
        )
    ),
    # Qwen 2.5 with YaRN (factor 4 over 512 positions): of the 16 frequencies 2 are kept, 5
    # ramped between, 9 divided by 4, and cos/sin scaled by 0.1 ln 4 + 1.
    "qwen2_yarn": Qwen2Config(
        **_config(
            "Qwen2ForCausalLM",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            },
            tie_word_embeddings=False,
        )
    ),
    # Qwen 3: RMSNorm on each head's q and k before RoPE; head_dim independent of hidden.
    "qwen3": Qwen3Config(
        **_config(
            "Qwen3ForCausalLM",
            4096,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        )
    ),
    # Mistral as v0.2 and later ship it: no sliding window, every layer global; head_dim 96.
    "mistral_global": MistralConfig(
        **_config(
            "MistralForCausalLM",
            2048,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=96,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        )
    ),
    # Mistral: the same sliding window on every layer.
    "mistral": MistralConfig(
        **_config(
            "MistralForCausalLM",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=SLIDING_WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        )
    ),
    # Gemma 3 text: sliding layers (RoPE theta 1e4) interleaved with full ones (1e6), (1 + w)
    # norms around attention and MLP, QK-norm, scores scaled by query_pre_attn_scalar**-0.5
    # (48, not head_dim 32), embeddings times sqrt(hidden), gelu_pytorch_tanh. Untied: tied
    # (as released Gemma 3 is), every seed and size tried here falls into repeating 1-7 tokens
    # within 32 greedy steps.
    "gemma3": Gemma3TextConfig(**_gemma3(tie_word_embeddings=False)),
    # Gemma 3 tied, as released: the head reads the embedding unscaled (only the input is
    # multiplied by sqrt(hidden)). Its greedy tokens repeat (3 distinct in 32): it is there
    # for the logits more than for decoding.
    "gemma3_tied": Gemma3TextConfig(**_gemma3(tie_word_embeddings=True)),
}


def _is_offset_norm(module: torch.nn.Module) -> bool:
    """Whether a norm multiplies by (1 + weight) (Gemma's, initialised to zeros) rather than by
    its weight (Llama's, initialised to ones)."""
    return type(module).__name__.startswith("Gemma")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter re-drawn from one seeded generator, in the order of named_parameters:
    matrices and biases N(0, STD); a norm's weight 1 + N(0, STD), or N(0, STD) for a (1 + w)
    norm, so its scale is neither exactly 1 nor 0."""
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights come once
            owner = modules[name.rpartition(".")[0]]
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * STD
            if "norm" in type(owner).__name__.lower():
                offset = 0.0 if _is_offset_norm(owner) else 1.0
                param.copy_(offset + noise)
            else:
                param.copy_(noise)


@functools.cache
def _tokenizer() -> Any:
    """The embedded model's tokenizer, loaded once."""
    from transformers import AutoTokenizer

    from kmesh.compute.embedded import ensure_embedded_model

    return AutoTokenizer.from_pretrained(ensure_embedded_model())


def build_family_folder(name: str, folder: str | Path, seed: int = 0) -> Path:
    """A model folder of family `name` (config.json, model.safetensors, the embedded model's
    tokenizer) with random float32 weights drawn from `seed`, loadable by transformers, vLLM and
    kmesh.compute.loader.load_model."""
    folder = Path(folder)
    config = FAMILIES[name]
    tokenizer = _tokenizer()
    assert len(tokenizer) <= config.vocab_size, (len(tokenizer), config.vocab_size)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == config.architectures, saved["architectures"]
    return folder
