"""The executor against transformers' eager forward on a tiny random model of every family
(tests/model_families.py): the prompt's logits, and 32 greedy tokens after it.

Bound: ATOL = 2e-5 max abs on float32 logits (of magnitude 4-6 here). KMesh attends with torch's
sdpa kernel, transformers' eager path with explicit matmul + softmax: the same operations summed
in another order. Measured here (2 threads and 1), max abs over the 48-token prompt: llama2
2.3e-6, llama3 6.6e-6, llama_linear 4.3e-6, qwen2 5.1e-6, qwen2_yarn 5.7e-6, qwen3 2.9e-6,
mistral 5.0e-6, gemma3 3.7e-6, gemma3_tied 3.2e-6 (each exactly transformers' own sdpa-vs-eager
difference: KMesh equals transformers' sdpa path bit for bit); on the 31 decode steps, one token
against the cached KV, at most 1.0e-5 (mistral). The bound is 3x the worst prompt figure. The
greedy paths' smallest top-1 margin is 1.7e-4 (llama_linear), 17x the decode differences. A
wrong window, RoPE scaling, norm offset, bias or scale moves logits by 1e-1 or more: removing the
window moves them by 0.65 to 7.3 past the window's first 16 positions.
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kmesh.bench.quality import greedy_decode
from kmesh.compute.executor import SequenceInput
from kmesh.compute.loader import load_model
from tests.model_families import FAMILIES, VOCAB_SIZE

ATOL = 2e-5
STEPS = 32
PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass "
    "lantern and a notebook in which he recorded the colour of the sea, the direction of the "
    "wind, and the names of the ships that passed the rocks below."
)
WINDOWED = tuple(name for name, c in FAMILIES.items() if getattr(c, "sliding_window", None))
# vLLM 0.32's CPU attention kernels' head sizes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def prompt_ids(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(PROMPT)["input_ids"])


def eager(folder, **overrides) -> torch.nn.Module:
    """transformers' model of `folder` in float32 with eager attention, config fields replaced
    by `overrides`."""
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", **overrides
    ).eval()


def reference_greedy(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> list[int]:
    """`steps` argmax tokens, each from a full forward of the whole sequence so far (no cache)."""
    sequence = tokens.tolist()
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(logits.argmax()))
    return sequence[len(tokens) :]


def reference_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens[None]).logits[0]


@pytest.fixture(scope="module")
def pair(family_folder):
    """`pair(name)`: (KMesh's loaded model, transformers' eager model) of family `name`."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            folder = family_folder(name)
            loaded[name] = (load_model(folder), eager(folder))
        return loaded[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_logits_match_transformers(pair, name):
    kmesh, hf = pair(name)
    tokens = prompt_ids(kmesh.tokenizer)
    executor = kmesh.executor
    out = executor.forward([SequenceInput(tokens, torch.arange(len(tokens)))])[0]
    diff = (executor.logits(out.hidden) - reference_logits(hf, tokens)).abs().max().item()
    assert diff <= ATOL, f"{name}: max abs logit difference {diff:.3g}"


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_match_transformers(pair, name):
    kmesh, hf = pair(name)
    tokens = prompt_ids(kmesh.tokenizer)
    executor = kmesh.executor
    positions = torch.arange(len(tokens))
    out = executor.forward([SequenceInput(tokens, positions)])[0]
    ours = greedy_decode(
        executor, [out.as_context(positions)], executor.logits(out.hidden[-1:]), STEPS
    )[0]
    reference = reference_greedy(hf, tokens, STEPS)
    assert len(set(reference)) > 1, "degenerate reference: one token repeated"
    assert ours == reference


@pytest.mark.parametrize("name", WINDOWED)
def test_the_window_changes_transformers_output_on_the_prompt(family_folder, name):
    """The prompt is 3x the window and the window-free model differs: the two tests above fail
    if the executor ignored a window. Positions inside the first window agree."""
    folder = family_folder(name)
    window = FAMILIES[name].sliding_window
    hf = eager(folder)
    tokens = prompt_ids(AutoTokenizer.from_pretrained(folder))
    assert len(tokens) >= 3 * window
    unwindowed = eager(folder, sliding_window=FAMILIES[name].max_position_embeddings)
    windowed_logits = reference_logits(hf, tokens)
    diff = (reference_logits(unwindowed, tokens) - windowed_logits).abs().amax(dim=-1)
    assert diff[:window].max() <= ATOL
    assert diff[window:].min() > 100 * ATOL, diff
    assert reference_greedy(unwindowed, tokens, 4) != reference_greedy(hf, tokens, 4)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_family_keeps_to_the_sizes_vllm_runs_and_uses_its_features(name):
    config = FAMILIES[name]
    head_dim = _head_dim(config)
    assert head_dim in CPU_HEAD_SIZES
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert 64 <= config.hidden_size <= 256
    assert 2 <= config.num_hidden_layers <= (6 if name.startswith("gemma3") else 4)
    assert config.vocab_size >= VOCAB_SIZE
    rope = config.rope_parameters
    if name.startswith("gemma3"):
        assert config.query_pre_attn_scalar != head_dim
        assert config.layer_types[0] == "sliding_attention"
        assert set(config.layer_types) == {"sliding_attention", "full_attention"}
        assert {p["rope_theta"] for p in rope.values()} == {1e4, 1e6}
        return
    if rope["rope_type"] != "default":
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        plain = 1.0 / rope["rope_theta"] ** exponents
        assert not torch.allclose(inv_freq, plain)
        if rope["rope_type"] in ("llama3", "yarn"):
            # Some frequencies kept and some scaled: both branches of the scaling are used.
            assert torch.isclose(inv_freq, plain).any()
        if rope["rope_type"] == "yarn":
            assert math.isclose(attention_factor, 0.1 * math.log(rope["factor"]) + 1)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def test_the_families_vary_what_users_models_vary():
    """Contexts, head dims, GQA ratios and vocabularies differ across the families, so that no
    fixed number in the code can pass by matching one shape."""
    configs = FAMILIES.values()
    assert {2048, 4096, 32768} <= {c.max_position_embeddings for c in configs}
    dims = {_head_dim(c) for c in configs}
    assert min(dims) == 32 and max(dims) == 256 and len(dims) >= 4
    assert {1, 2, 4} <= {c.num_attention_heads // c.num_key_value_heads for c in configs}
    assert len({c.vocab_size for c in configs}) >= 2


def test_some_families_tie_their_embeddings_and_some_do_not():
    assert {config.tie_word_embeddings for config in FAMILIES.values()} == {True, False}
