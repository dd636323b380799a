"""Streamed text never splits a character and adds up to the text of all tokens."""

import pytest

from kmesh.serve.detokenizer import REPLACEMENT_CHAR, IncrementalDecoder

pytestmark = pytest.mark.model


def test_pieces_hold_back_split_characters_and_add_up_to_the_whole(real_model):
    tokenizer = real_model.tokenizer
    text = "Tea 🙂 and 日本 — naïve"
    token_ids = tokenizer(text)["input_ids"]
    partial = [
        i
        for i in range(1, len(token_ids))
        if tokenizer.decode(token_ids[:i]).endswith(REPLACEMENT_CHAR)
    ]
    assert partial, "the example must split a character across tokens"
    decoder = IncrementalDecoder(tokenizer)
    pieces = []
    for token_id in token_ids:
        decoder.add([token_id])
        pieces.append(decoder.take_complete())
    pieces.append(decoder.take_rest())
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    assert decoder.num_tokens == len(token_ids)


def test_special_tokens_are_not_text(real_model):
    tokenizer = real_model.tokenizer
    decoder = IncrementalDecoder(tokenizer)
    decoder.add([*tokenizer("Done.")["input_ids"], tokenizer.eos_token_id])
    assert decoder.take_rest() == "Done."
