"""Real adapters of the embedded model: they load with peft, change its answers, an activated one
leaves every token before its invocation to the base model, and training is reproducible."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from kmesh.adapters.prepare import MANIFEST, adapter_dir
from kmesh.adapters.recipes import AdapterRecipe, recipes
from kmesh.adapters.train import BaseModel, chat_ids, load_base_model, train_adapter
from kmesh.compute.embedded import ensure_embedded_model

pytestmark = pytest.mark.model

NEW_TOKENS = 16


def fresh_base() -> BaseModel:
    """A base model of its own (PeftModel.from_pretrained wraps the model it is given)."""
    return load_base_model(ensure_embedded_model())


@pytest.fixture(scope="module")
def base() -> BaseModel:
    """The plain base model, never wrapped."""
    return fresh_base()


def prompt_ids(base: BaseModel, adapter: AdapterRecipe, question: str) -> list[int]:
    """The adapter's inference prompt: with the generation prompt for a plain LoRA, with the
    invocation sequence (as text, tokenized with the rest) for an activated one."""
    user = [{"role": "user", "content": question}]
    if adapter.invocation_text is None:
        return chat_ids(base.tokenizer, user, generation_prompt=True)
    text = base.tokenizer.apply_chat_template(user, add_generation_prompt=False, tokenize=False)
    return list(base.tokenizer(text + adapter.invocation_text, add_special_tokens=False).input_ids)


def greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_prepared_adapters_land_in_their_recipe_folders_and_load_with_peft(
    lora_adapters, activated_adapters
):
    for kind, folders in (("lora", lora_adapters), ("activated", activated_adapters)):
        for adapter, folder in zip(recipes(kind, 2), folders, strict=True):
            assert folder == adapter_dir(adapter)
            assert folder.name.startswith(f"{kind}-{adapter.name}-")
            assert {"adapter_config.json", "adapter_model.safetensors", MANIFEST} <= {
                p.name for p in folder.iterdir()
            }
            manifest = json.loads((folder / MANIFEST).read_text())
            assert manifest["kind"] == kind and manifest["name"] == adapter.name
            assert manifest["persona"] == adapter.persona.system_prompt
            assert manifest["recipe_digest"] == folder.name.rsplit("-", 1)[1]
            assert manifest["steps"] == adapter.steps and manifest["final_loss"] < 1.0
            config = json.loads((folder / "adapter_config.json").read_text())
            assert config["r"] == 8 and config["lora_alpha"] == 16
            if kind == "activated":
                assert manifest["invocation_text"] == adapter.invocation_text
                assert config["alora_invocation_tokens"] == manifest["invocation_tokens"]
            else:
                assert "invocation_tokens" not in manifest
                assert config.get("alora_invocation_tokens") is None
            model = PeftModel.from_pretrained(fresh_base().model, folder)
            assert sum("lora_A" in name for name, _ in model.named_parameters()) == 4 * 30


def test_the_invocation_sequence_is_the_special_token_then_the_name_and_a_newline(
    base, activated_adapters
):
    tokenizer = base.tokenizer
    for adapter, folder in zip(recipes("activated", 2), activated_adapters, strict=True):
        tokens = json.loads((folder / MANIFEST).read_text())["invocation_tokens"]
        assert tokens[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
        assert tokenizer.decode(tokens) == adapter.invocation_text
        # Tokenized as part of a whole prompt's text, the sequence comes out verbatim at its end.
        assert prompt_ids(base, adapter, "Why?")[-len(tokens) :] == tokens


@pytest.mark.parametrize("kind", ["lora", "activated"])
def test_an_adapter_changes_the_base_models_greedy_answer_to_its_question(
    base, kind, lora_adapters, activated_adapters
):
    folders = lora_adapters if kind == "lora" else activated_adapters
    for adapter, folder in zip(recipes(kind, 2), folders, strict=True):
        ids = prompt_ids(base, adapter, adapter.questions[0])
        model = PeftModel.from_pretrained(fresh_base().model, folder).eval()
        adapted, plain = greedy(model, ids), greedy(base.model, ids)
        assert adapted != plain, base.tokenizer.decode(adapted)


def test_an_activated_adapter_leaves_tokens_before_its_invocation_to_the_base_model(
    base, activated_adapters
):
    adapter, folder = recipes("activated", 1)[0], activated_adapters[0]
    model = PeftModel.from_pretrained(fresh_base().model, folder).eval()
    question = adapter.questions[0]
    # The generation prompt has <|im_start|> but not the name: no invocation, all base model.
    lacking = chat_ids(base.tokenizer, [{"role": "user", "content": question}], True)
    lacking += greedy(base.model, lacking)[:6]
    assert torch.equal(logits(model, lacking), logits(base.model, lacking))

    invoked = prompt_ids(base, adapter, question)
    invocation = json.loads((folder / MANIFEST).read_text())["invocation_tokens"]
    start = len(invoked) - len(invocation)
    invoked += greedy(model, invoked)[:6]
    adapted, plain = logits(model, invoked), logits(base.model, invoked)
    assert torch.equal(adapted[:start], plain[:start])
    # From the invocation on, every position's logits differ from the base model's.
    assert (adapted[start:] - plain[start:]).abs().amax(dim=-1).min() > 1e-3


def test_training_the_same_recipe_twice_gives_bit_identical_weights(tmp_path: Path):
    # Short answers and two steps keep it quick; the procedure is the full one.
    adapter = dataclasses.replace(recipes("activated", 1)[0], answer_tokens=8)
    trainer = fresh_base()  # one base for both: training must leave it as it was
    first = train_adapter(adapter, trainer, tmp_path / "first", steps=2)
    second = train_adapter(adapter, trainer, tmp_path / "second", steps=2)
    assert first.steps == second.steps == 2
    assert first.final_loss == second.final_loss
    weights = [
        (tmp_path / n / "adapter_model.safetensors").read_bytes() for n in ("first", "second")
    ]
    assert weights[0] == weights[1]
    parameters = list(trainer.model.named_parameters())
    assert not any("lora" in name for name, _ in parameters)
    assert all(p.requires_grad for _, p in parameters)
