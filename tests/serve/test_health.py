"""GET /health and what every request gets once the engine failed (the reference engine, in
process, its step made to fail)."""

import pytest
from fastapi.testclient import TestClient

from kmesh.serve.app import create_app
from kmesh.serve.reference_backend import ReferenceBackend

pytestmark = pytest.mark.model


def test_a_failed_engine_answers_503_with_what_failed_until_restarted(real_model, monkeypatch):
    backend = ReferenceBackend(real_model, kv_cache_tokens=1024)
    with TestClient(create_app(backend)) as client:
        body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.get("/health").json()["status"] == "ready"

        def fail() -> None:
            raise RuntimeError("out of memory in a test")

        monkeypatch.setattr(backend._engine, "step", fail)
        for request in (body, {**body, "stream": True}, body):  # the failing one, then later ones
            response = client.post("/v1/completions", json=request)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "server_error"
            assert error["message"] == (
                "the reference engine failed (RuntimeError); the server log has the details: "
                "restart kmesh serve"
            )
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "failed",
            "error": "the reference engine failed (RuntimeError)",
        }
        metrics = client.get("/metrics").text
        assert 'kmesh_requests_total{route="POST /v1/completions",status="503"} 3.0' in metrics
