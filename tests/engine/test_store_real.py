"""Two `kmesh generate` processes sharing one store, on the embedded model (issue: external
restoration): the second restores the first's 2048-token prompt state instead of computing it."""

import json

import pytest

from tests.conftest import run_kmesh

SENTENCES = (
    "The river rose three feet overnight and the bridge inspectors closed the east lane. ",
    "Farmers moved their equipment to higher ground while the council met in emergency session. ",
    "By noon the mayor had asked the state for sandbags, pumps and two engineering crews. ",
)


def _long_text(tokenizer, tokens: int) -> str:
    text = ""
    i = 0
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += SENTENCES[i % len(SENTENCES)]
        i += 1
    return text


@pytest.mark.model
def test_a_second_process_restores_a_2048_token_prompt(real_model, store_factory):
    store = store_factory(capacity="256M")  # 129 blocks of 720 KiB
    text = _long_text(real_model.tokenizer, 2048)
    ids = real_model.tokenizer(text)["input_ids"]
    args = ("generate", text, "--max-tokens", "16", "--json", "--store", store.socket)
    first = run_kmesh(*args)
    assert first.returncode == 0, first.stderr
    second = run_kmesh(*args)
    assert second.returncode == 0, second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    full_blocks = (len(ids) - 1) // 16
    # The first computes the whole prompt cold; the second restores every full block of it.
    assert a["stats"]["restored_tokens"] == 0 and a["stats"]["computed_tokens"] == len(ids)
    assert b["stats"]["restored_tokens"] == full_blocks * 16
    assert b["stats"]["computed_tokens"] == len(ids) - full_blocks * 16
    assert a["token_ids"] == b["token_ids"]
