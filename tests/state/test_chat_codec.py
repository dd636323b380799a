import pytest
from hypothesis import given
from hypothesis import strategies as st

from kmesh.errors import ContractError
from kmesh.state import chat_codec as codec
from kmesh.state.segments import Role


def chatml(messages, add_generation_prompt):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def byte_tokens(text):
    return list(text.encode())


messages_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.text(max_size=20),
        },
        optional={
            "kmesh_role": st.sampled_from([r.value for r in Role]),
            "id": st.sampled_from(["a", "b", "c"]),
        },
    ),
    min_size=1,
    max_size=5,
)


@given(messages_strategy)
def test_messages_round_trip_and_tokens_equal_the_whole_template(messages):
    ids = {}
    for m in messages:  # one id, one templated message
        key = (m["role"], m["content"])
        if "id" in m and ids.setdefault(m["id"], key) != key:
            return
    prompt = codec.decode(messages, chatml, byte_tokens)
    assert prompt.token_ids == tuple(byte_tokens(chatml(messages, True)))
    back = codec.encode(prompt)
    for original, decoded in zip(messages, back, strict=True):
        assert decoded["role"] == original["role"]
        assert decoded["content"] == original["content"]
        assert decoded.get("id") == original.get("id")
        default = "shared" if original["role"] == "system" else "private"
        assert decoded["kmesh_role"] == original.get("kmesh_role", default)
    assert prompt.segments[-1].role is Role.INSTRUCTION


def test_a_template_that_rewrites_earlier_text_is_refused():
    def numbered(messages, add_generation_prompt):
        return f"{len(messages)} messages: " + "".join(m["content"] for m in messages)

    with pytest.raises(ContractError, match="incrementally"):
        codec.decode(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            numbered,
            byte_tokens,
        )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "at least one message"),
        ([{"role": "user"}], "string 'role' and a string 'content'"),
        ([{"role": "user", "content": "x", "kmesh_role": "boss"}], "kmesh_role 'boss'"),
    ],
)
def test_malformed_messages_are_refused(messages, message):
    with pytest.raises(ContractError, match=message):
        codec.decode(messages, chatml, byte_tokens)


@pytest.mark.model
def test_segments_of_the_real_template_concatenate_to_its_prompt(real_model):
    tokenizer = real_model.tokenizer
    messages = [
        {"role": "system", "content": "You are a careful reviewer."},
        {"role": "user", "content": "Check this plan: build the bridge in spring."},
        {"role": "assistant", "content": "Spring floods are a risk."},
        {"role": "user", "content": "What would you change?"},
    ]

    def render(msgs, add_generation_prompt):
        return tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def tokenize(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = codec.decode(messages, render, tokenize)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert list(prompt.token_ids) == list(expected)
    assert len(prompt.segments) == 5


def named_chatml(messages, add_generation_prompt):
    """ChatML with OpenAI's speaker names, as templates that render `name` do."""
    text = "".join(
        f"<|im_start|>{m['role']}{' ' + m['name'] if 'name' in m else ''}\n{m['content']}"
        "<|im_end|>\n"
        for m in messages
    )
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_a_speakers_name_is_rendered_as_the_template_renders_it():
    messages = [
        {"role": "system", "content": "A council."},
        {"role": "user", "content": "Fix the bridge.", "name": "alice"},
        {"role": "user", "content": "Fix the roof.", "name": "bob"},
    ]
    prompt = codec.decode(messages, named_chatml, byte_tokens)
    assert list(prompt.token_ids) == byte_tokens(named_chatml(messages, True))
