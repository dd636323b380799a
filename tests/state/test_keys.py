from hypothesis import given
from hypothesis import strategies as st

from kmesh.state.keys import KeyNamespace, block_key, encode_part

NS = KeyNamespace(model="m" * 64)


def test_every_namespace_part_changes_the_key():
    tokens = [5, 6, 7, 8]
    keys = {
        block_key(NS, None, tokens),
        block_key(KeyNamespace(model="n" * 64), None, tokens),
        block_key(KeyNamespace(model=NS.model, adapter="lora-a"), None, tokens),
        block_key(KeyNamespace(model=NS.model, tenant_salt="t1"), None, tokens),
        block_key(NS, block_key(NS, None, [1]), tokens),
    }
    assert len(keys) == 5


def test_none_and_empty_string_are_different_parts():
    assert block_key(KeyNamespace("m", tenant_salt=""), None, [1]) != block_key(
        KeyNamespace("m", tenant_salt=None), None, [1]
    )


def test_parts_cannot_be_shifted_between_fields():
    # A joined-string key would confuse ("ab", "c") with ("a", "bc"); tagged parts do not.
    a = KeyNamespace(model="ab", adapter="c")
    b = KeyNamespace(model="a", adapter="bc")
    assert block_key(a, None, [1]) != block_key(b, None, [1])


def test_same_block_after_a_different_prefix_gets_a_different_key():
    first = block_key(NS, block_key(NS, None, [1, 2, 3, 4]), [9, 9, 9, 9])
    second = block_key(NS, block_key(NS, None, [5, 6, 7, 8]), [9, 9, 9, 9])
    assert first != second


def test_keys_are_deterministic_sha256_digests():
    key = block_key(NS, None, [1, 2, 3])
    assert key == block_key(KeyNamespace(model="m" * 64), None, (1, 2, 3))
    assert len(key) == 32


part_lists = st.lists(
    st.tuples(st.sampled_from(["model", "adapter", "tokens"]), st.none() | st.binary(max_size=8)),
    max_size=4,
)


@given(part_lists, part_lists)
def test_part_encoding_is_injective(a, b):
    def encode(parts):
        return b"".join(encode_part(tag, value) for tag, value in parts)

    assert (encode(a) == encode(b)) == (a == b)
