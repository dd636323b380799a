"""The reference engine's exact sharing on a tiny random model of every family
(tests/model_families.py): a prompt that extends a cached one, and forks of a trunk, give the
tokens a fresh computation gives. Prompts are several times the windowed families' window, so a
sliding-window layer's mask is in play wherever KV is reused."""

import pytest

from kmesh.compute.loader import load_model
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from tests.conftest import random_tokens

# One of each mechanism the description adds (scaled RoPE, bias, QK-norm, windows, Gemma's
# layers); tests/compute/test_families.py checks every family's forward against transformers.
NAMES = ("llama3", "qwen2_yarn", "qwen3", "mistral", "gemma3")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=())
BASE = tuple(random_tokens(70, seed=3, high=4000))  # 4 blocks of 16 and a partial one
LONGER = (*BASE, *random_tokens(23, seed=4, high=4000))


@pytest.fixture(scope="module")
def models(family_folder):
    return {name: load_model(family_folder(name)) for name in NAMES}


def engine_of(model, **options) -> Engine:
    return Engine(model.executor, model.fingerprint, **options)


def fresh(model, prompt, params=GREEDY):
    engine = engine_of(model, prefix_caching=False)
    return engine.generate([Request("fresh", tuple(prompt), params)])[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_prompt_extending_a_cached_one_equals_a_fresh_computation(models, name):
    model = models[name]
    engine = engine_of(model)
    engine.generate([Request("a", BASE, GREEDY)])
    [extended] = engine.generate([Request("b", LONGER, GREEDY)])
    assert extended.stats.reused_tokens >= 64  # the cached blocks of BASE
    assert extended.output_ids == fresh(model, LONGER).output_ids


@pytest.mark.parametrize("name", NAMES)
def test_forks_equal_independent_requests(models, name):
    model = models[name]
    engine = engine_of(model)
    engine.declare_family("f", "t", 3)
    sampled = [
        SamplingParams(max_tokens=9, temperature=1.0, stop_token_ids=(), seed=i) for i in range(3)
    ]
    trunk, *branches = engine.generate(
        [
            Request("t", LONGER, None, retain=True),
            *(Request(f"b{i}", (), sampled[i], parent_id="t") for i in range(3)),
        ]
    )
    assert trunk.finish_reason == "retained"
    for i, out in enumerate(branches):
        assert out.stats.reused_tokens == len(LONGER)
        assert out.output_ids == fresh(model, LONGER, sampled[i]).output_ids
