"""The traffic mix of `kmesh bench load`: seeded, every kind, valid bodies where 200 is expected."""

import random

from kmesh.serve.schema import ChatCompletionRequest, CompletionRequest
from kmesh.workloads.serve_traffic import KINDS, next_exchange

KEYS = ("key-a", "key-b")


def test_the_mix_is_seeded_and_holds_every_kind():
    rng, again_rng = random.Random(3), random.Random(3)
    first = [next_exchange(rng, KEYS, i) for i in range(20)]
    again = [next_exchange(again_rng, KEYS, i) for i in range(20)]
    assert first == again
    rng = random.Random(0)
    kinds = {next_exchange(rng, KEYS, i).kind for i in range(400)}
    assert kinds == set(KINDS)


def test_every_exchange_that_expects_200_is_a_valid_body():
    rng = random.Random(1)
    for i in range(200):
        exchange = next_exchange(rng, KEYS, i)
        if exchange.expect != (200,):
            continue
        model = ChatCompletionRequest if "chat" in exchange.path else CompletionRequest
        model.model_validate(exchange.body)  # raises if the bench sent a bad one by mistake
        assert exchange.key in KEYS
