"""The executor under trained adapters against peft on the embedded model.

Bound: 1e-3 max abs on fp32 logits, as for the base model against transformers
(tests/compute/test_executor_real.py). A plain adapter is compared with peft's merged model (W +
s B A folded into the weights: a different rounding than applying the delta, so not bit-equal);
an activated adapter with peft's own aLoRA forward, which cannot be merged.
"""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from kmesh.compute.executor import SequenceInput
from kmesh.compute.lora import LoraUse, load_adapter
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, SamplingParams

pytestmark = pytest.mark.model

QUESTIONS = (
    "What do you do on a rainy day?",
    "Describe your favourite meal.",
    "How should I learn to swim?",
    "What is the best way to travel?",
    "Tell me about the moon.",
)
LOGIT_BOUND = 1e-3


def _peft(real_model, folder, merge):
    base = AutoModelForCausalLM.from_pretrained(real_model.path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    return model.merge_and_unload() if merge else model


def _prompts(real_model, adapter):
    ids = []
    for question in QUESTIONS:
        chat = real_model.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=adapter.invocation_tokens is None,
            tokenize=True,
        )
        chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
        ids.append(tuple(chat + list(adapter.invocation_tokens or ())))
    return ids


@pytest.mark.parametrize("kind", ["lora", "activated"])
def test_the_executor_under_an_adapter_equals_peft(
    real_model, lora_adapters, activated_adapters, kind
):
    folder = (lora_adapters if kind == "lora" else activated_adapters)[0]
    adapter = load_adapter(folder)
    reference = _peft(real_model, folder, merge=kind == "lora")
    executor = real_model.executor
    prompts = _prompts(real_model, adapter)
    for ids in prompts:
        tokens = torch.tensor(ids)
        use = LoraUse.of(adapter, ids)
        assert use is not None
        out = executor.forward([SequenceInput(tokens, torch.arange(len(ids)), lora=use)])[0]
        with torch.inference_mode():
            expected = reference(input_ids=tokens[None]).logits[0]
        assert (executor.logits(out.hidden) - expected).abs().max().item() <= LOGIT_BOUND
    engine = Engine(executor, real_model.fingerprint, adapters=[adapter])
    params = SamplingParams(max_tokens=32, stop_token_ids=())
    ours = engine.generate(
        Request(f"q{i}", ids, params, adapter=adapter.name) for i, ids in enumerate(prompts)
    )
    for ids, out in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            generated = reference.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
            )
        assert list(out.output_ids) == generated[0, len(ids) :].tolist()
