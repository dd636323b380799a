"""`kmesh serve --api-keys`: keys, tenants and isolation, over the reference engine in process."""

import json
import statistics
import time

import pytest
from fastapi.testclient import TestClient

from kmesh.errors import InvalidRequestError
from kmesh.serve.app import create_app
from kmesh.serve.reference_backend import ReferenceBackend
from kmesh.serve.tenants import load_api_keys, tenant_salt
from tests.serve.test_app import SHARED

KEYS = {"key-of-team-a": "team-a", "key-of-team-b": "team-b", "2nd-key-of-a": "team-a"}
A, B, A2 = ({"Authorization": f"Bearer {key}"} for key in KEYS)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


@pytest.fixture(scope="module")
def client(real_model, keys_file):
    backend = ReferenceBackend(real_model, kv_cache_tokens=8192)
    with TestClient(create_app(backend, api_keys=load_api_keys(keys_file))) as client:
        yield client


def complete(client, headers, prompt, **body):
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **body}
    response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["kmesh"]


@pytest.mark.model
@pytest.mark.parametrize(
    "headers, says",
    [
        ({}, "needs an API key"),
        ({"Authorization": "key-of-team-a"}, "needs an API key"),
        ({"Authorization": "Bearer not-a-key-at-all"}, "not valid"),
    ],
)
def test_a_request_without_a_valid_key_gets_401(client, headers, says):
    for response in (
        client.post("/v1/completions", json={"prompt": "x"}, headers=headers),
        client.post("/tokenize", json={"prompt": "x"}, headers=headers),
        client.get("/v1/models", headers=headers),
    ):
        assert response.status_code == 401
        assert says in response.json()["error"]["message"]
        assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.model
def test_health_and_metrics_need_no_key(client):
    assert client.get("/health").json()["status"] == "ready"
    assert client.get("/metrics").status_code == 200


@pytest.mark.model
def test_a_tenant_never_reuses_another_tenants_prefix_whatever_salt_it_sends(client):
    prompt = SHARED + "The oldest speaker said"
    complete(client, B, prompt, cache_salt="shared")
    for salt in ("shared", None, "shared#tenant=team-b", "#tenant=team-b"):
        stats = complete(client, A, prompt, **({} if salt is None else {"cache_salt": salt}))
        assert stats["reused_tokens"] == 0 and stats["restored_tokens"] == 0, salt
    # The control: A's own state is reused, under either of A's keys.
    assert complete(client, A2, prompt, cache_salt="shared")["reused_tokens"] > 0


@pytest.mark.model
def test_a_tenants_first_token_time_does_not_depend_on_another_tenants_cache(client):
    """Measured: A's prompt after B sent the same one, against a prompt nobody sent; the control
    (A's own prompt again) shows the test would see a hit."""

    def prompt(i):  # about 1000 tokens, each a prompt of its own
        return f"Record {i}. " + SHARED * 11

    def seconds(headers, text):
        started = time.perf_counter()
        complete(client, headers, text)
        return time.perf_counter() - started

    after_b, cold, own = [], [], []
    for i in range(5):
        complete(client, B, prompt(2 * i))
        after_b.append(seconds(A, prompt(2 * i)))
        cold.append(seconds(A, prompt(2 * i + 1)))
        own.append(seconds(A, prompt(2 * i + 1)))
    ratio = statistics.median(after_b) / statistics.median(cold)
    assert 0.7 < ratio < 1.4, (after_b, cold)
    assert statistics.median(own) < 0.5 * statistics.median(cold), (own, cold)


def test_a_client_salt_only_subdivides_its_tenant():
    assert tenant_salt("team-a", "kmesh-approx:x").startswith("kmesh-approx:")
    # No client salt of B's can equal a salt of A's: A's name follows the last separator.
    assert tenant_salt("team-b", "x#tenant=team-a") != tenant_salt("team-a", "x")
    assert tenant_salt("team-a", None) == tenant_salt("team-a", "") == "#tenant=team-a"


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "is not JSON"),
        ("[]", "non-empty object"),
        ("{}", "non-empty object"),
        ('{"short": "a"}', "shorter than 8"),
        ('{"long-enough-key": "team a"}', "a tenant name is"),
        ('{"long-enough-key": 3}', "a tenant name is"),
    ],
)
def test_a_bad_keys_file_is_refused_with_what_to_fix(tmp_path, text, says):
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(InvalidRequestError, match=says):
        load_api_keys(path)
    with pytest.raises(InvalidRequestError, match="cannot read"):
        load_api_keys(tmp_path / "missing.json")
