"""Segments spelled as a prompt (kmesh/state/request_meta.py `segment_spans`)."""

from kmesh.state.request_meta import parse_kmesh_params, segment_spans


class _BosTokenizer:
    """Adds BOS (2) with special tokens; a character per token otherwise."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([2] if add_special_tokens else []) + [ord(c) for c in text]}


def test_a_text_first_segment_starts_after_the_tokenizers_bos_and_token_ids_carry_their_own():
    text = parse_kmesh_params({"segments": [{"text": "ab"}, {"text": "c"}]})
    assert segment_spans(_BosTokenizer(), text)[0] == [2, 97, 98, 99]
    ids = parse_kmesh_params({"segments": [{"token_ids": [2, 97]}, {"text": "c"}]})
    assert segment_spans(_BosTokenizer(), ids)[0] == [2, 97, 99]
