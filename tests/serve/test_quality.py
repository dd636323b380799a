"""`kmesh serve --reuse-messages --quality`: a chat under an approximate salt asks for the target;
one the server cannot meet (no calibration of the embedded model does) is served exactly, with
plain exact service's tokens, and the response's kmesh object says so."""

from fastapi.testclient import TestClient

from kmesh.serve.app import create_app
from kmesh.serve.reference_backend import ReferenceBackend
from kmesh.state.recovery_meta import RecoverySpec
from tests.serve.test_app import council_chat


def test_an_unmet_quality_target_is_served_exactly_and_the_response_says_so(real_model):
    backend = ReferenceBackend(real_model, kv_cache_tokens=4096)
    reuse = RecoverySpec(quality="greedy")
    with TestClient(create_app(backend, reuse_messages=reuse)) as server:

        def chat(order, salt):
            messages, _ = council_chat(order)
            body = {"messages": messages, "max_tokens": 6, "temperature": 0, "cache_salt": salt}
            response = server.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        chat([0, 1, 2], "kmesh-approx:agents")
        asked = chat([2, 1, 0], "kmesh-approx:agents")
        plain = chat([2, 1, 0], "exact-tenant")
    stats = asked["kmesh"]
    assert stats["quality"]["target"] == "greedy" and stats["quality"]["served"] == "exact"
    assert "reason" in stats["quality"]
    assert "recovery" not in stats and stats["recovered_tokens"] == 0
    assert "quality" not in plain["kmesh"]  # an exact salt takes no reuse: nothing asked
    answer = asked["choices"][0]["message"]["content"]
    assert answer == plain["choices"][0]["message"]["content"]
