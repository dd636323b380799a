"""`kmesh serve --api-keys`: keys, tenants and isolation, over the reference engine in process."""

import pytest
from fastapi.testclient import TestClient

from kmesh.errors import InvalidRequestError
from kmesh.serve.app import create_app
from kmesh.serve.reference_backend import ReferenceBackend
from kmesh.state.tenants import load_api_keys, tenant_salt
from tests.serve.conftest import (
    KEY_A,
    check_tenancy,
    keys_file,
    tenancy_observations,
)


@pytest.fixture(scope="module")
def client(real_model, tmp_path_factory):
    keys = load_api_keys(keys_file(tmp_path_factory.mktemp("keys")))
    backend = ReferenceBackend(real_model, kv_cache_tokens=8192)
    with TestClient(create_app(backend, api_keys=keys)) as client:
        yield client


@pytest.mark.model
@pytest.mark.parametrize(
    "headers, says",
    [
        ({}, "needs an API key"),
        ({"Authorization": KEY_A}, "needs an API key"),
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
def test_a_tenant_never_reuses_or_times_another_tenants_state(client):
    """Measured: A's first-token time after B sent the same prompt is that of a prompt nobody
    sent; the control (A's own prompt again) shows the test would see a hit."""
    check_tenancy(tenancy_observations(client))


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
