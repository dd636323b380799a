"""Fuzzing: the HTTP API from its own OpenAPI schema (schemathesis), and the `kmesh` object
(hypothesis). Nothing a client sends may get a 5xx or an unexplained refusal.

The server is the reference engine on the embedded model, in process, with a KV cache of 96
tokens so that no generated body can hold the engine long (a bigger request gets a 400 that
says so). KMESH_FUZZ_EXAMPLES (default 20) sets the examples per route; docs/guide/service.md has a
longer run's figures.
"""

import json
import os

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core import NotSet

from kmesh.errors import KMeshError
from kmesh.serve.app import create_app
from kmesh.serve.reference_backend import ReferenceBackend
from kmesh.state.request_meta import parse_kmesh_params

EXAMPLES = int(os.environ.get("KMESH_FUZZ_EXAMPLES", "20"))


@pytest.fixture(scope="module")
def client(real_model):
    app = create_app(ReferenceBackend(real_model, kv_cache_tokens=96))
    with TestClient(app) as client:  # starts the engine (the app's lifespan)
        yield client


def test_no_generated_request_gets_a_server_error(client):
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    tried = 0
    for operation in schema.get_all_operations():
        operation = operation.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def fuzz(case):
            nonlocal tried
            body = None if isinstance(case.body, NotSet) else json.dumps(case.body)
            headers = {
                **(case.headers or {}),
                "Content-Type": case.media_type or "application/json",
            }
            response = client.request(
                case.method, case.formatted_path, content=body, headers=headers, params=case.query
            )
            tried += 1
            assert response.status_code < 500, (
                case.method,
                case.formatted_path,
                body,
                response.text,
            )
            if response.status_code >= 400:
                assert response.json()["error"]["message"], response.text

        fuzz()
    assert tried >= EXAMPLES  # every route was reached
    print(f"fuzz: {tried} requests, none answered 5xx")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
KEYS = st.sampled_from(
    ["family", "branches", "close", "segments", "messages", "separator", "recovery", "keep_output"]
)


@given(st.dictionaries(KEYS, JSON, max_size=5) | JSON)
@settings(max_examples=300, deadline=None)
def test_any_kmesh_object_is_parsed_or_refused_with_a_message(value):
    try:
        parse_kmesh_params(value)
    except KMeshError as error:
        assert str(error)
