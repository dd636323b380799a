"""The scheduler half's request tracker (kmesh/vllm/tracked.py): its tokenizer, loaded before the
first request with segments reaches vLLM's schedule call."""

import logging
from types import SimpleNamespace

import pytest

from kmesh.compute import loader
from kmesh.compute.embedded import ensure_embedded_model
from kmesh.compute.loader import load_tokenizer
from kmesh.state.request_meta import parse_kmesh_params, segment_spans
from kmesh.vllm.tracked import RequestTracker

SEGMENTS = {
    "segments": [
        {"text": "The council of the river towns meets once a year. ", "role": "shared", "id": "a"},
        {"text": "In one word, the towns are", "role": "instruction"},
    ]
}


def request_with_segments(model: str) -> SimpleNamespace:
    ids, _ = segment_spans(load_tokenizer(model), parse_kmesh_params(SEGMENTS))
    return SimpleNamespace(
        request_id="r",
        prompt_token_ids=ids,
        cache_salt=None,
        lora_request=None,
        kv_transfer_params={"kmesh": SEGMENTS},
    )


def test_a_warmed_tracker_spells_the_first_segments_without_loading_a_tokenizer(monkeypatch):
    model = str(ensure_embedded_model())
    request = request_with_segments(model)
    tracker = RequestTracker(model, "fingerprint", 32)
    tracker.warm()

    def no_loading(path):
        raise AssertionError("the tokenizer was loaded while a request was tracked")

    monkeypatch.setattr(loader, "load_tokenizer", no_loading)
    tracked = tracker.track(request)
    assert [span.segment_id for span in tracked.spans] == ["a", None]
    assert tracked.spans[-1].end == len(request.prompt_token_ids)


def test_a_model_without_a_tokenizer_is_logged_at_warm_and_fails_where_segments_need_it(
    tmp_path, caplog
):
    model = str(ensure_embedded_model())
    tracker = RequestTracker(str(tmp_path / "no-model"), "fingerprint", 32)
    with caplog.at_level(logging.INFO, logger="kmesh.vllm.tracked"):
        tracker.warm()
    assert "no tokenizer for" in caplog.text
    with pytest.raises(OSError):
        tracker.track(request_with_segments(model))
