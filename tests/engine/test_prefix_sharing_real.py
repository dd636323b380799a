"""Exact prefix sharing on the embedded model: a 1000-token shared prefix."""

import pytest

from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from tests.conftest import random_tokens

pytestmark = pytest.mark.model

PARAMS = SamplingParams(max_tokens=24)


@pytest.fixture(scope="module")
def prompts(real_model):
    vocab = real_model.config.vocab_size
    shared = random_tokens(1000, seed=1, high=vocab)
    return (
        tuple(shared + random_tokens(40, seed=2, high=vocab)),
        tuple(shared + random_tokens(37, seed=3, high=vocab)),
    )


def test_second_request_reuses_the_block_aligned_prefix_and_matches_cold(real_model, prompts):
    first, second = prompts
    engine = Engine(real_model.executor, real_model.fingerprint, block_size=16)
    engine.generate([Request("a", first, PARAMS)])
    [warm] = engine.generate([Request("b", second, PARAMS)])
    cold_engine = Engine(real_model.executor, real_model.fingerprint, block_size=16)
    [cold] = cold_engine.generate([Request("c", second, PARAMS)])
    assert warm.stats.reused_tokens == 1000 // 16 * 16
    assert warm.stats.computed_tokens == len(second) - 992
    assert cold.stats.reused_tokens == 0
    assert warm.output_ids == cold.output_ids


def test_different_tenants_do_not_share_the_prefix(real_model, prompts):
    first, second = prompts
    engine = Engine(real_model.executor, real_model.fingerprint)
    engine.generate([Request("a", first, PARAMS, tenant_salt="alice")])
    [other] = engine.generate([Request("b", second, PARAMS, tenant_salt="bob")])
    assert other.stats.reused_tokens == 0
    assert other.stats.computed_tokens == len(second)
