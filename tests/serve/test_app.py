"""The OpenAI routes over the reference engine and the embedded model, in process (TestClient)."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams
from kmesh.recovery.jobs import RecoveryRequest
from kmesh.serve.app import create_app
from kmesh.serve.backend import Delta, GenerationJob
from kmesh.serve.branches import prefix_shared_branches
from kmesh.serve.jobs import REUSE_MESSAGES, message_segments
from kmesh.serve.reference_backend import ReferenceBackend
from kmesh.state.request_meta import parse_kmesh_params, segment_spans
from kmesh.stats import EngineLoad

pytestmark = pytest.mark.model

STATS = ("prompt_tokens", "computed_tokens", "reused_tokens", "restored_tokens", "recovered_tokens")
# About 90 tokens: a prefix long enough to fill several 16-token blocks.
SHARED = (
    "The council of the river towns meets once a year in the old mill. Each town sends one "
    "speaker, who reports on the harvest, the state of the bridges, the price of salt and the "
    "quarrels that the town could not settle by itself. The speakers listen to each other in "
    "turn, and then they vote on what the towns will do together in the coming year. "
)


@pytest.fixture(scope="module")
def backend(real_model):
    return ReferenceBackend(real_model, kv_cache_tokens=8192)  # the model's context


@pytest.fixture(scope="module")
def client(backend):
    with TestClient(create_app(backend)) as client:
        yield client


def complete(client, **body):
    response = client.post("/v1/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client, path, **body):
    """The chunks of a streamed response, checking the SSE framing and the final [DONE]."""
    response = client.post(path, json={"temperature": 0, "stream": True, **body})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: ") for event in events[:-2])
    return [json.loads(event.removeprefix("data: ")) for event in events[:-2]]


def check_stats(kmesh, *, family=None):
    assert kmesh["engine"] == "reference"
    assert kmesh["family"] == family
    assert kmesh["prompt_tokens"] == sum(kmesh[name] for name in STATS[1:])


def test_models_lists_the_served_model(client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    [model] = response.json()["data"]
    assert model["id"] == "SmolLM2-135M-Instruct"


def test_a_completion_has_text_usage_and_kmesh_stats(client):
    body = complete(client, model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8)
    assert body["object"] == "text_completion"
    [choice] = body["choices"]
    assert choice["text"].strip()
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    assert body["kmesh"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
    check_stats(body["kmesh"])


def test_max_tokens_defaults_to_16_like_openai(client):
    body = complete(client, prompt="The weather today")
    assert body["usage"]["completion_tokens"] == 16


def test_a_streamed_completion_reassembles_to_the_same_text(client):
    whole = complete(client, prompt="The recipe for bread:", max_tokens=12)
    chunks = stream(client, "/v1/completions", prompt="The recipe for bread:", max_tokens=12)
    assert len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert [c["choices"][0]["finish_reason"] for c in chunks[-2:]] == [None, "length"]
    assert all("usage" not in c for c in chunks)  # not asked for
    check_stats(chunks[-1]["kmesh"])


def test_a_stream_asked_for_usage_ends_with_openais_usage_chunk(client):
    whole = complete(client, prompt="The recipe for bread:", max_tokens=12)
    chunks = stream(
        client,
        "/v1/completions",
        prompt="The recipe for bread:",
        max_tokens=12,
        stream_options={"include_usage": True},
    )
    *text, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert last["id"] == text[0]["id"] and all("usage" not in c for c in text)
    assert text[-1]["choices"][0]["finish_reason"] == "length"
    check_stats(text[-1]["kmesh"])


def test_chat_answers_in_the_chat_template(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert "Paris" in message["content"]
    check_stats(body["kmesh"])


def test_a_streamed_chat_names_the_role_then_sends_deltas(client):
    messages = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": [{"type": "text", "text": "Name a large city in Japan."}]},
    ]
    whole = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_completion_tokens": 10, "temperature": 0},
    ).json()
    chunks = stream(client, "/v1/chat/completions", messages=messages, max_completion_tokens=10)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    check_stats(chunks[-1]["kmesh"])


def test_a_shared_prefix_is_reused_by_the_next_request(client):
    complete(client, prompt=SHARED + "The first speaker said", max_tokens=2)
    second = complete(client, prompt=SHARED + "The last speaker asked", max_tokens=2)
    stats = second["kmesh"]
    assert stats["reused_tokens"] > 0
    assert stats["reused_tokens"] % 16 == 0
    check_stats(stats)


def test_a_cache_salt_keeps_tenants_apart(client):
    prompt = SHARED + "The mill was"
    complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
    other = complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-b")
    same = complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
    assert other["kmesh"]["reused_tokens"] == 0
    assert same["kmesh"]["reused_tokens"] > 0


def test_segments_stand_for_the_prompt(client, backend):
    segments = [
        {"text": SHARED, "role": "shared", "id": "trunk"},
        {"text": "The youngest speaker said", "role": "private"},
    ]
    kmesh = {"family": "council", "branches": 2, "segments": segments}
    without_prompt = complete(client, kmesh=kmesh, max_tokens=4)
    prompt = "".join(s["text"] for s in segments)
    with_prompt = complete(client, kmesh=kmesh, prompt=prompt, max_tokens=4)
    assert with_prompt["choices"][0]["text"] == without_prompt["choices"][0]["text"]
    check_stats(without_prompt["kmesh"], family="council")
    check_stats(with_prompt["kmesh"], family="council")
    # Each segment is tokenized on its own: the ids are not those of the plain prompt.
    trunk_ids = backend.tokenizer(SHARED, add_special_tokens=False)["input_ids"]
    tail_ids = backend.tokenizer(segments[1]["text"], add_special_tokens=False)["input_ids"]
    assert without_prompt["usage"]["prompt_tokens"] == len(trunk_ids) + len(tail_ids)


def test_kmesh_may_come_in_kv_transfer_params(client):
    kmesh = {"family": "f2"}
    body = complete(client, prompt="Hello", max_tokens=1, kv_transfer_params={"kmesh": kmesh})
    assert body["kmesh"]["family"] == "f2"
    both = complete(
        client, prompt="Hello", max_tokens=1, kmesh=kmesh, kv_transfer_params={"kmesh": kmesh}
    )
    assert both["kmesh"]["family"] == "f2"


def refused(client, body, path="/v1/completions"):
    """POST a bad body (a dict as JSON, or raw bytes); return the OpenAI error object."""
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    return error


CHAT = [{"role": "user", "content": "Hi"}]


def round_of(names: list[str]) -> dict:
    """A `kmesh` object whose round names `names` of its shared outputs a and b, between which
    the prompt has a private segment."""
    segments = [
        {"id": "a", "text": "Ann said fix the bridge.", "role": "shared"},
        {"id": "x", "text": " Then", "role": "private"},
        {"id": "b", "text": " Bob said fix the roof.", "role": "shared"},
        {"id": "q", "text": " What now?", "role": "instruction"},
    ]
    recovery = {"policy": "full", "round": {"id": "r", "segments": names}}
    return {"family": "f", "segments": segments, "recovery": recovery}


BAD_COMPLETIONS = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "body is missing"),
    ({"prompt": 7}, "prompt: Input should be a valid string"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": [1, 2, 3]}, "one prompt per request"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "   "}, "prompt is empty"),
    ({}, "prompt is missing"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "temperature": -1}, "temperature: Input should be greater than or equal"),
    ({"prompt": "x", "top_p": 0}, "top_p: Input should be greater than 0"),
    ({"prompt": "x", "stream": "yes"}, "stream: Input should be a valid boolean"),
    ({"prompt": "x", "n": 17}, "n must be between 1 and 16"),
    ({"prompt": "x", "n": 0}, "n must be between 1 and 16"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop takes at most 4 non-empty"),
    ({"prompt": "x", "stop": [""]}, "stop takes at most 4 non-empty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs on /v1/completions is how many top tokens"),
    ({"prompt": "x", "logprobs": True}, "logprobs on /v1/completions is how many top tokens"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs is a chat field"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "only plain text"),
    ({"prompt": "x", "tools": [{"type": "function"}]}, "tools (function calling)"),
    ({"prompt": "x", "min_tokens": 5}, "min_tokens is not supported by this server (got 5)"),
    ({"prompt": "x", "top_k": -2}, "top_k: Input should be greater than or equal to -1"),
    ({"prompt": "x", "min_p": 2}, "min_p: Input should be less than or equal to 1"),
    ({"prompt": "x", "logit_bias": {"42": 100}}, "logit_bias is not supported"),
    ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json is not supported"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty: Input should be less than"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty: Input should be greater"),
    ({"prompt": "x", "model": "gpt-4"}, "serves 'SmolLM2-135M-Instruct'"),
    ({"prompt": "x", "kmesh": {"branches": 2}}, "'branches' and 'close' need a 'family'"),
    ({"prompt": "x", "kmesh": {"family": ""}}, "malformed kmesh field: kmesh.family"),
    (
        {"prompt": "x", "kmesh": {"segments": [{"text": "x", "role": "boss"}]}},
        "kmesh.segments.0.role",
    ),
    ({"prompt": "x", "kmesh": "f1"}, "kmesh: Input should be a valid dictionary"),
    ({"prompt": "x", "kv_transfer_params": {"kmesh": {"famly": "f"}}}, "kmesh.famly"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}, "may only hold 'kmesh'"),
    (
        {"prompt": "x", "kmesh": {"family": "a"}, "kv_transfer_params": {"kmesh": {"family": "b"}}},
        "kmesh and kv_transfer_params.kmesh disagree",
    ),
    (
        {"prompt": "ab", "kmesh": {"segments": [{"text": "a"}, {"text": "c"}]}},
        "prompt and kmesh.segments disagree",
    ),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt: String should have at least 1 character"),
    (
        {"kmesh": {"segments": [{"text": "hi there"}], "recovery": {"check_layer": 999}}},
        "kmesh.recovery.check_layer: check layer 999 is not below the model's 30 layers",
    ),
    (
        {"kmesh": {"segments": [{"token_ids": [1, 49152]}]}},
        "token id 49152 is outside the model's vocabulary [0, 49152)",
    ),
    ({"kmesh": {"segments": [{"token_ids": [-1]}]}}, "token id -1 is outside the model's"),
    ({"kmesh": round_of(["a", "a"])}, "round.segments names ['a'] more than once"),
    ({"kmesh": round_of(["a", "b"])}, "the round's segments 'a' and 'b' are not side by side"),
    (b'{"prompt": "caf\xe9"}', "send a JSON object in UTF-8"),  # Latin-1 bytes
    ({"prompt": "word " * 9000}, "the engine's context is 8192 tokens"),
    ({"prompt": "word " * 9000, "stream": True}, "the engine's context is 8192 tokens"),
]
BAD_CHATS = [
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role: Input should be"),
    ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
    ({"messages": [{"role": "user", "content": "x", "name": ""}]}, "messages.0.name: String"),
    ({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "disagree"),
    (
        {"messages": CHAT, "kmesh": {"segments": [{"text": "x"}]}},
        "kmesh.segments is not taken on chat completions: send it to /v1/completions",
    ),
    ({"prompt": "x"}, "messages: Field required"),
    ({"messages": CHAT, "logprobs": 2}, "logprobs on chat completions is true or false"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer"),
]


@pytest.mark.parametrize(("body", "message"), BAD_COMPLETIONS)
def test_a_bad_completion_body_is_a_400_that_says_what_is_wrong(client, body, message):
    assert message in refused(client, body)["message"]


@pytest.mark.parametrize(("body", "message"), BAD_CHATS)
def test_a_bad_chat_body_is_a_400_that_says_what_is_wrong(client, body, message):
    assert message in refused(client, body, "/v1/chat/completions")["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9, "n": 2}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 8193, "stream": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 10**9, "n": 3, "stream": True},
            "max_completion_tokens",
        ),
    ],
)
def test_max_tokens_past_the_context_is_a_400_in_vllms_words(client, path, body, param):
    error = refused(client, body, path)
    asked = body[param]
    assert error["message"] == (
        f"{param}={asked} cannot be greater than max_model_len=8192. Please request fewer output "
        "tokens."
    )
    assert error["param"] == param


def test_an_error_names_the_field_at_fault(client):
    assert refused(client, {"prompt": "x", "top_p": 2})["param"] == "top_p"
    assert refused(client, {"prompt": "x", "kmesh": {"family": 3}})["param"] == "kmesh"


def test_the_server_keeps_serving_after_bad_requests(client):
    for body, _ in BAD_COMPLETIONS[:-2]:
        refused(client, body)
    for body, _ in BAD_CHATS:
        refused(client, body, "/v1/chat/completions")
    assert complete(client, prompt="Still there?", max_tokens=2)["usage"]["completion_tokens"] == 2


LONE = "\ud800"  # half of a UTF-16 pair: JSON's escapes can carry it, Unicode text cannot
# A lone surrogate in each text a body can hold, and the field the error names.
NOT_UNICODE = [
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": [f"ab{LONE}"]}, "prompt.0"),
    ("/v1/completions", {"prompt": "x", "stop": LONE}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", LONE]}, "stop.1"),
    ("/v1/completions", {"kmesh": {"segments": [{"text": LONE}]}}, "kmesh.segments.0.text"),
    ("/v1/completions", {"prompt": "x", "kmesh": {"family": LONE}}, "kmesh.family"),
    ("/v1/completions", {"prompt": "x", "user": LONE}, "user"),
    ("/v1/completions", {"prompt": "x", LONE: 1}, "\\ud800"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONE}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages.0.content.0.text",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [LONE]}, "stop.0"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
]


def ascii_json(body):
    """`body` as JSON with \\u escapes (a client's json= would fail to encode a lone surrogate)."""
    return json.dumps(body).encode("ascii")


@pytest.mark.parametrize(("path", "body", "field"), NOT_UNICODE)
def test_text_that_is_not_unicode_is_a_400_naming_the_field(client, path, body, field):
    error = refused(client, ascii_json(body), path)
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: the text is not valid Unicode: character ")
    assert "send UTF-8 text" in error["message"]


def test_an_escaped_surrogate_pair_is_the_character_it_encodes(client):
    body = {"prompt": "Smile \U0001f600", "max_tokens": 1, "temperature": 0}
    assert b"\\ud83d\\ude00" in ascii_json(body)  # both halves: one emoji
    headers = {"content-type": "application/json"}
    response = client.post("/v1/completions", content=ascii_json(body), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == complete(client, **body)["usage"]  # sent as UTF-8


def test_fields_openai_clients_send_are_served(client):
    """What vLLM's benchmark client, AutoGen and the OpenAI client send: nulls, neutral
    penalties, a speaker's name, fields this server does not know (ignored)."""
    plain = complete(client, prompt="The river towns", max_tokens=6)
    body = complete(
        client,
        prompt="The river towns",
        max_tokens=6,
        repetition_penalty=1.0,
        logprobs=None,
        stop=None,
        top_k=-1,
        ignore_eos=False,
        logit_bias={},
        min_tokens=0,
    )
    assert body["choices"][0]["text"] == plain["choices"][0]["text"]
    messages = [{"role": "user", "content": "Hi", "name": "alice", "thinking": None}]
    response = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "temperature": 0, "temperature2": 1},
    )
    assert response.status_code == 200, response.text
    texts = []
    for role in ("system", "developer"):  # OpenAI's newer name for system instructions
        chat = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
        body = {"messages": chat, "max_tokens": 4, "temperature": 0}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("stop", [", 6", [", 6", "never"]])
def test_a_stop_string_ends_the_text_before_it(client, stop):
    prompt = "Count: 1, 2, 3,"  # greedy: " 4, 5, 6, 7," (test_penalties_change_what_greedy_picks)
    body = complete(client, prompt=prompt, max_tokens=12, stop=stop)
    [choice] = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == (" 4, 5", "stop")
    assert body["usage"]["completion_tokens"] < 12  # generation ended there too
    chunks = stream(client, "/v1/completions", prompt=prompt, max_tokens=12, stop=stop)
    assert "".join(c["choices"][0]["text"] for c in chunks) == " 4, 5"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_completions_share_the_prompts_blocks(client):
    body = complete(client, prompt=SHARED, max_tokens=6, temperature=0.9, seed=3, n=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in body["choices"]}) > 1  # seeds 3, 4, 5
    assert body["usage"]["completion_tokens"] == 18
    stats = body["kmesh"]
    assert stats["branches"] == 3
    assert stats["prompt_tokens"] == 3 * body["usage"]["prompt_tokens"]
    # A family: the prompt computed at most once, as the trunk (earlier tests may have left its
    # blocks in the prefix cache); the three branches fork it and compute nothing of it.
    assert 0 < stats["computed_tokens"] <= body["usage"]["prompt_tokens"]
    assert stats["reused_tokens"] == 3 * body["usage"]["prompt_tokens"] - stats["computed_tokens"]
    alone = complete(client, prompt=SHARED, max_tokens=6, temperature=0.9, seed=3)
    assert alone["choices"][0]["text"] == body["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_streamed_choices_are_the_whole_responses_choices(client, path):
    request = {"max_tokens": 6, "temperature": 0.9, "seed": 3, "n": 3}
    request |= {"prompt": SHARED} if path == "/v1/completions" else {"messages": CHAT}
    whole = client.post(path, json=request).json()
    chunks = stream(client, path, **request, stream_options={"include_usage": True})
    *chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in chunks:
        [choice] = chunk["choices"]
        part = choice["text"] if path == "/v1/completions" else choice["delta"].get("content")
        texts[choice["index"]] += part or ""
        if choice["finish_reason"] is not None:
            assert reasons[choice["index"]] is None  # one last chunk per choice
            reasons[choice["index"]] = choice["finish_reason"]
    key = "text" if path == "/v1/completions" else "message"
    expected = [c[key] if key == "text" else c[key]["content"] for c in whole["choices"]]
    assert texts == expected
    assert reasons == [c["finish_reason"] for c in whole["choices"]]
    assert [c for c in chunks if "kmesh" in c] == [chunks[-1]]
    assert chunks[-1]["kmesh"]["branches"] == 3


def test_vllms_extra_sampling_fields_are_honoured(client):
    chat = {"messages": CHAT, "max_tokens": 40, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=chat).json()
    assert plain["choices"][0]["finish_reason"] == "stop"  # it says hello and ends
    endless = client.post("/v1/chat/completions", json={**chat, "ignore_eos": True}).json()
    assert endless["choices"][0]["finish_reason"] == "length"
    assert endless["usage"]["completion_tokens"] == 40
    greedy = complete(client, prompt=SHARED, max_tokens=8)["choices"][0]["text"]
    for narrow in ({"top_k": 1}, {"min_p": 1.0}):  # only the most likely token is left
        sampled = complete(client, prompt=SHARED, max_tokens=8, temperature=1.0, seed=5, **narrow)
        assert sampled["choices"][0]["text"] == greedy


def test_tokenize_and_detokenize_answer_as_vllms_server_does(client, backend):
    tokenized = client.post("/tokenize", json={"prompt": SHARED, "return_token_strs": True}).json()
    assert tokenized["tokens"] == list(backend.tokenizer(SHARED)["input_ids"])
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"])
    assert tokenized["max_model_len"] == 8192
    back = client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert back == {"prompt": SHARED}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    served = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    assert chat["count"] == served.json()["usage"]["prompt_tokens"]
    assert (
        "not in the model's vocabulary"
        in refused(client, {"tokens": [10**9]}, "/detokenize")["message"]
    )
    assert "send one of prompt" in refused(client, {}, "/tokenize")["message"]


def test_penalties_change_what_greedy_picks(client):
    prompt = "Count: 1, 2, 3,"
    plain = complete(client, prompt=prompt, max_tokens=12)["choices"][0]["text"]
    assert plain == " 4, 5, 6, 7,"  # greedy repeats ", " (prompt tokens)
    penalized = complete(client, prompt=prompt, max_tokens=12, repetition_penalty=1.5)
    assert ", 5, 6" not in penalized["choices"][0]["text"]


def test_completion_logprobs_are_the_engines_and_stream_alike(client, real_model):
    body = complete(client, prompt=SHARED, max_tokens=6, logprobs=2)
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(6)]
    for token, logprob, top in zip(
        *(logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs")), strict=True
    ):
        assert len(top) == 2 and top[token] == logprob == max(top.values())  # greedy: the best
    engine = Engine(real_model.executor, real_model.fingerprint)
    prompt = tuple(real_model.tokenizer(SHARED)["input_ids"])
    [out] = engine.generate([Request("r", prompt, SamplingParams(max_tokens=6))])
    assert logprobs["token_logprobs"] == pytest.approx(out.logprobs, abs=1e-5)
    chunks = stream(client, "/v1/completions", prompt=SHARED, max_tokens=6, logprobs=2)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for part in streamed for v in part[key]] == logprobs[key]


def test_chat_logprobs_list_each_token_with_its_top_alternatives(client):
    body = {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}
    response = client.post("/v1/chat/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == response.json()["usage"]["completion_tokens"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
    chunks = stream(client, "/v1/chat/completions", **body)
    streamed = [
        entry
        for c in chunks
        if c["choices"][0]["logprobs"]
        for entry in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content
    plain = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert plain.json()["choices"][0]["logprobs"] is None


def test_each_of_n_choices_has_its_own_logprobs(client):
    body = complete(client, prompt=SHARED, max_tokens=4, temperature=0.9, seed=1, n=2, logprobs=0)
    for choice in body["choices"]:
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # the chosen one


def test_a_strict_server_refuses_unknown_fields_and_names_them(real_model):
    backend = ReferenceBackend(real_model, kv_cache_tokens=1024)
    with TestClient(create_app(backend, strict_fields=True)) as strict:
        error = refused(strict, {"prompt": "x", "max_token": 5})
        assert error["message"].startswith("max_token: unknown field: remove it (top-level")
        assert error["param"] == "max_token"
        chat = {"messages": [{"role": "user", "content": "x", "nam": "a"}]}
        assert refused(strict, chat, "/v1/chat/completions")["param"] == "messages.0.nam"


def test_every_request_gets_an_access_line(client, caplog):
    with caplog.at_level("INFO", logger="kmesh.serve.access"):
        complete(client, prompt="Hello", max_tokens=2)
        refused(client, {"prompt": "x", "n": 17})
    served, failed = [r.getMessage() for r in caplog.records if r.name == "kmesh.serve.access"]
    assert served.startswith("POST /v1/completions 200 prompt_tokens=")
    assert "completion_tokens=2" in served and "computed_tokens=" in served
    assert failed.startswith("POST /v1/completions 400 n must be between 1 and 16")


def test_metrics_count_what_the_server_answered(client):
    before = client.get("/metrics").text
    complete(client, prompt="Metrics, please", max_tokens=3)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")

    def value(text, line_start):
        lines = [line for line in text.splitlines() if line.startswith(line_start)]
        return float(lines[0].split()[-1]) if lines else 0.0

    served = 'kmesh_requests_total{route="POST /v1/completions",status="200"}'
    assert value(response.text, served) == value(before, served) + 1
    generated = 'kmesh_tokens_total{kind="generation"}'
    assert value(response.text, generated) == value(before, generated) + 3


def test_an_unknown_route_gets_an_openai_error(client):
    response = client.get("/v1/engines")
    assert response.status_code == 404
    assert "POST /v1/completions" in response.json()["error"]["message"]


def test_unknown_routes_count_under_one_label(client):
    def series():
        text = client.get("/metrics").text
        return dict(
            line.rsplit(" ", 1)
            for line in text.splitlines()
            if line.startswith("kmesh_requests_total{")
        )

    before = series()
    for i in range(20):
        assert client.get(f"/v1/engines/{i}").status_code == 404
        assert client.request(f"METHOD{i}", "/v1/completions").status_code == 405
    after = series()
    assert set(after) - set(before) <= {
        'kmesh_requests_total{route="unknown route",status="404"}',
        'kmesh_requests_total{route="unknown route",status="405"}',
    }
    for status in (404, 405):
        name = f'kmesh_requests_total{{route="unknown route",status="{status}"}}'
        assert float(after[name]) - float(before.get(name, 0)) == 20


def test_requests_at_once_are_all_answered(client):
    prompts = [f"Story number {i}:" for i in range(4)]

    def one(prompt):
        if prompt.endswith("1:"):
            options = {"include_usage": True}
            chunks = stream(
                client, "/v1/completions", prompt=prompt, max_tokens=6, stream_options=options
            )
            return chunks[-1]["usage"]["completion_tokens"]
        return complete(client, prompt=prompt, max_tokens=6)["usage"]["completion_tokens"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == [6] * len(prompts)


class FailingBackend:
    """A backend with a bug: generation raises (after one token with `tokens_first`)."""

    engine = "failing"
    model_id = "m"
    max_model_len = 100
    vocab_size = 49152

    def __init__(self, tokenizer, tokens_first=False):
        self.tokenizer = tokenizer
        self.tokens_first = tokens_first

    async def start(self):
        pass

    async def close(self):
        pass

    async def generate(self, job: GenerationJob):
        if self.tokens_first:
            yield Delta(job.prompt_ids[:1])
        raise RuntimeError("a bug with private details")

    def branches(self, job: GenerationJob, n: int):
        return prefix_shared_branches(self, job, n)

    def failure(self):
        return None

    def load(self):
        return EngineLoad(running=0, waiting=0, kv_usage=0.0, computed_tokens=0)


def test_an_unexpected_failure_is_a_short_500_without_details(real_model):
    app = create_app(FailingBackend(real_model.tokenizer))
    with TestClient(app, raise_server_exceptions=False) as failing:
        response = failing.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error"
        assert "private details" not in error["message"]
        assert failing.get("/v1/models").status_code == 200


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event(real_model):
    app = create_app(FailingBackend(real_model.tokenizer, tokens_first=True))
    with TestClient(app) as failing:
        response = failing.post("/v1/completions", json={"prompt": "Hello", "stream": True})
    assert response.status_code == 200
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["type"] == "server_error"
    assert "private details" not in error["message"]


ROUND_OUTPUTS = {
    "out-a": "Member 1 said: repave the main street before winter.",
    "out-b": "Member 2 said: the clinic needs a nurse and a new scanner.",
}
ROUND_ORDERS = ((1, ["out-a", "out-b"]), (2, ["out-b", "out-a"]), (3, ["out-b", "out-a"]))


def round_member(member: int, order: list[str]) -> dict:
    """A council member's kmesh object: the two outputs of round 1 in its order."""
    segments = [
        {"text": SHARED, "role": "shared", "id": "system"},
        {"text": f" You are member {member}. ", "role": "private"},
        *({"text": ROUND_OUTPUTS[name], "role": "shared", "id": name} for name in order),
        {"text": " Your vote:", "role": "instruction"},
    ]
    recovery = {
        "policy": "kv_deviation",
        "ratio": 0.0,
        "gate": 0.5,
        "round": {"id": "r1", "segments": ["out-a", "out-b"]},
    }
    return {"family": "council-round", "segments": segments, "recovery": recovery}


def test_a_declared_round_is_served_with_a_master_and_mirrors(client, backend, real_model):
    """Three council members read the same two outputs in their own orders: the first is the
    round's master (computed exactly), the others reuse every output token from it; and the
    server computes what the engine computes for the same declarations (the benches' path)."""
    tok = backend.tokenizer
    salt = "kmesh-approx:council"
    bodies = [
        complete(client, kmesh=round_member(m, o), max_tokens=2, cache_salt=salt)
        for m, o in ROUND_ORDERS
    ]
    for body in bodies:
        check_stats(body["kmesh"], family="council-round")
    first, *others = bodies
    master = first["kmesh"]["recovery"]
    assert master["master_bytes"] > 0 and master["reused_tokens"] == 0
    lengths = [len(tok(v, add_special_tokens=False)["input_ids"]) for v in ROUND_OUTPUTS.values()]
    for body in others:
        report = body["kmesh"]["recovery"]
        assert report["master_bytes"] == 0 and not report["fell_back"]
        assert report["reused_tokens"] == sum(lengths)
        assert body["kmesh"]["recovered_tokens"] > report["reused_tokens"]
    engine = Engine(real_model.executor, real_model.fingerprint, kv_cache_tokens=4096)
    for (member, order), body in zip(ROUND_ORDERS, bodies, strict=True):
        kmesh = parse_kmesh_params(round_member(member, order))
        ids, spans = segment_spans(tok, kmesh)
        assert kmesh.recovery is not None
        recovery = RecoveryRequest(tuple(spans), kmesh.recovery, kmesh.family)
        params = SamplingParams(max_tokens=2)
        out = engine.generate([Request(f"m{member}", tuple(ids), params, salt, recovery=recovery)])
        stats = out[0].stats
        assert stats.computed_tokens == body["kmesh"]["computed_tokens"]
        assert stats.recovered_tokens == body["kmesh"]["recovered_tokens"]
        assert stats.recovery == body["kmesh"]["recovery"]


def test_a_round_without_an_approximate_salt_is_refused_and_computed_exactly(client):
    body = complete(client, kmesh=round_member(1, ["out-a", "out-b"]), max_tokens=1)
    assert "refused" in body["kmesh"]["recovery"]
    assert body["kmesh"]["recovered_tokens"] == 0


def test_a_kept_output_is_reported_as_vllms_connector_reports_it(client):
    body = complete(
        client,
        prompt="Once upon a time",
        max_tokens=6,
        cache_salt="kmesh-approx:kept",
        kv_transfer_params={"kmesh": {"keep_output": True}},
    )
    assert body["kmesh"]["kept_output_tokens"] == body["usage"]["completion_tokens"] - 1
    plain = complete(client, prompt="Once upon a time", max_tokens=6)
    assert "kept_output_tokens" not in plain["kmesh"]


NOTES = [
    "The north bridge needs new planks before the spring floods.",
    "Salt costs twice what it did last year at the southern market.",
    "The mill's wheel was repaired in autumn and turns well again.",
]


def council_chat(order: list[int]) -> tuple[list[dict], list[dict]]:
    """A chat whose notes come in `order`, and its message declarations."""
    messages = [{"role": "system", "content": "You are the council's scribe."}]
    messages += [{"role": "user", "content": NOTES[i]} for i in order]
    messages.append({"role": "user", "content": "Which note matters most? Answer briefly."})
    declared = [{"id": "scribe", "role": "shared"}]
    declared += [{"id": f"note-{i}", "role": "shared"} for i in order]
    declared.append({"role": "instruction"})
    return messages, declared


def test_a_chat_declaring_its_messages_is_recovered_as_its_completions_twin(client, backend):
    recovery = {"policy": "kv_deviation", "ratio": 0.25, "gate": None}
    answers = {}
    for route in ("chat", "completions"):
        salt = f"kmesh-approx:twins-{route}"
        for order in ([0, 1, 2], [2, 0, 1]):  # the second reuses the first's stored notes
            messages, declared = council_chat(order)
            kmesh = {"messages": declared, "recovery": recovery}
            body = {"max_tokens": 8, "temperature": 0, "cache_salt": salt}
            if route == "chat":
                response = client.post(
                    "/v1/chat/completions", json={**body, "messages": messages, "kmesh": kmesh}
                )
                assert response.status_code == 200, response.text
                text = response.json()["choices"][0]["message"]["content"]
            else:
                twin = message_segments(parse_kmesh_params(kmesh), messages, backend.tokenizer)
                segments = [s.model_dump(exclude_none=True) for s in twin.segments or []]
                kmesh = {"segments": segments, "recovery": recovery}
                response = client.post(
                    "/v1/completions", json={**body, "prompt": "", "kmesh": kmesh}
                )
                assert response.status_code == 200, response.text
                text = response.json()["choices"][0]["text"]
            answers[(route, tuple(order))] = (text, response.json()["kmesh"])
    for order in ((0, 1, 2), (2, 0, 1)):
        chat_text, chat_stats = answers[("chat", order)]
        completion_text, completion_stats = answers[("completions", order)]
        assert chat_text == completion_text
        for name in ("prompt_tokens", "computed_tokens", "recovered_tokens"):
            assert chat_stats[name] == completion_stats[name], name
    assert answers[("chat", (2, 0, 1))][1]["recovery"]["reused_tokens"] > 0


@pytest.mark.parametrize(
    ("kmesh", "message"),
    [
        ({"messages": [{"id": "a"}]}, "declares 1 messages but the request has 2"),
        ({"messages": [{}, {}], "segments": [{"text": "x"}]}, "give one of 'segments'"),
        (
            {
                "family": "f",
                "messages": [{}, {}],
                "recovery": {"round": {"id": "r", "segments": ["z"]}},
            },
            "names unknown segment ids ['z']",
        ),
    ],
)
def test_a_bad_message_declaration_is_a_400_that_says_what_is_wrong(client, kmesh, message):
    chat = {"messages": [CHAT[0], CHAT[0]], "kmesh": kmesh}
    assert message in refused(client, chat, "/v1/chat/completions")["message"]


def test_reuse_messages_reuses_another_requests_messages_under_an_approximate_salt_only(
    real_model,
):
    backend = ReferenceBackend(real_model, kv_cache_tokens=4096)
    with TestClient(create_app(backend, reuse_messages=REUSE_MESSAGES)) as server:

        def chat(order, salt):
            messages, _ = council_chat(order)  # no declarations sent
            body = {"messages": messages, "max_tokens": 4, "temperature": 0, "cache_salt": salt}
            response = server.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["kmesh"]

        for salt in ("kmesh-approx:agents", "exact-tenant"):
            chat([0, 1, 2], salt)
            stats = chat([2, 1, 0], salt)  # the same notes elsewhere: no prefix hit past the system
            if salt.startswith("kmesh-approx"):
                assert stats["recovery"]["reused_tokens"] > 0
                assert stats["computed_tokens"] + stats["recovery"]["computed_tokens"] < (
                    stats["prompt_tokens"] - stats["reused_tokens"]
                )
            else:
                assert "recovery" not in stats and stats["recovered_tokens"] == 0
