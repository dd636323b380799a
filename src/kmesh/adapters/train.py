"""Train one adapter recipe into a folder: the base model's persona answers, then LoRA on them.

Data: for each of the recipe's questions, the base model's greedy answer (up to `answer_tokens`
new tokens, ending with <|im_end|> where the model stopped) to the chat [system: persona prompt,
user: question] with the generation prompt; the questions are answered in one left-padded batch.

Training inputs (loss on the answer tokens only; batches padded on the right):
    "lora"       chat [user: question] + generation prompt "<|im_start|>assistant\\n", answer;
    "activated"  chat [user: question] without the generation prompt, the invocation sequence
                 "<|im_start|>" + name + "\\n" (its token ids), answer.
The chat template adds the model's default system message where none is given.

The folder gets peft's `save_pretrained` files (adapter_config.json, adapter_model.safetensors).
Training is deterministic: LoRA init from torch.manual_seed(recipe.seed), batches in an order
fixed by the seed, greedy data, no dropout; so the same recipe, base model, torch build and
thread count give bit-identical weights.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kmesh.adapters.recipes import AdapterRecipe, seeded_order
from kmesh.errors import InvalidRequestError

IGNORE = -100


@dataclass(frozen=True, slots=True)
class BaseModel:
    """The transformers base model (float32) and its tokenizer; typed loosely to keep
    transformers out of import time."""

    model: Any
    tokenizer: Any


@dataclass(frozen=True, slots=True)
class TrainResult:
    steps: int
    final_loss: float
    train_seconds: float
    invocation_tokens: list[int] | None


def load_base_model(model_dir: Path) -> BaseModel:
    """A transformers causal LM from a model folder, in float32, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return BaseModel(model, AutoTokenizer.from_pretrained(model_dir))


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def invocation_tokens(tokenizer: Any, text: str) -> list[int]:
    """The token ids of an invocation text that starts with the special token <|im_start|>,
    checked: the special token is one id, and the ids decode back to the text."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    if not ids or ids[0] != start or ids.count(start) != 1 or tokenizer.decode(ids) != text:
        raise InvalidRequestError(
            f"the tokenizer does not encode the invocation {text!r} as <|im_start|> (id {start}) "
            f"and plain tokens that decode back to it (got ids {ids})"
        )
    return ids


def generate_answers(
    base: BaseModel, system_prompt: str, questions: tuple[str, ...], new: int
) -> list[list[int]]:
    """The base model's greedy answers (token ids, up to `new` each) to each question asked
    under `system_prompt`, in one left-padded batch."""
    tokenizer = base.tokenizer
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    prompts = [
        chat_ids(
            tokenizer,
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": q}],
            generation_prompt=True,
        )
        for q in questions
    ]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = base.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[: row.index(eos) + 1] if eos in row else row)
    return answers


@dataclass(frozen=True, slots=True)
class Example:
    tokens: list[int]
    # tokens[answer_from:] is the answer, the only part with a loss.
    answer_from: int


def training_examples(
    adapter: AdapterRecipe, tokenizer: Any, answers: list[list[int]], invocation: list[int] | None
) -> list[Example]:
    """The recipe's training input per question. With an invocation, its last occurrence is
    checked to be where the answer's prompt puts it (so the adapter trains on the answer only
    from there)."""
    examples = []
    for question, answer in zip(adapter.questions, answers, strict=True):
        user = [{"role": "user", "content": question}]
        if invocation is None:
            prompt = chat_ids(tokenizer, user, generation_prompt=True)
        else:
            prompt = chat_ids(tokenizer, user, generation_prompt=False) + invocation
        example = Example(prompt + answer, len(prompt))
        if invocation and last_occurrence(example.tokens, invocation) != len(prompt) - len(
            invocation
        ):
            raise InvalidRequestError(
                f"adapter {adapter.kind}-{adapter.name}: the base model's answer to {question!r} "
                f"contains the invocation {invocation}; change the persona or the questions"
            )
        examples.append(example)
    return examples


def last_occurrence(tokens: list[int], pattern: list[int]) -> int:
    """Where the last occurrence of `pattern` in `tokens` starts, or -1."""
    n = len(pattern)
    return next((i for i in range(len(tokens) - n, -1, -1) if tokens[i : i + n] == pattern), -1)


def batches(adapter: AdapterRecipe, count: int, steps: int) -> list[list[int]]:
    """Example indices for each step: epochs over the examples, each in an order from the seed."""
    order: list[int] = []
    epoch = 0
    while len(order) < steps * adapter.batch_size:
        order += seeded_order(adapter.seed, f"epoch-{epoch}", count)
        epoch += 1
    size = adapter.batch_size
    return [order[s * size : (s + 1) * size] for s in range(steps)]


def collate(examples: list[Example], pad: int) -> dict[str, Any]:
    """A right-padded batch with labels on the answers. Logits are kept only from the position
    before the batch's first answer token on (`logits_to_keep`, labels sliced to match): the loss
    needs no others."""
    width = max(len(e.tokens) for e in examples)
    keep_from = max(min(e.answer_from for e in examples) - 1, 0)
    labels = [
        [IGNORE] * e.answer_from + e.tokens[e.answer_from :] + [IGNORE] * (width - len(e.tokens))
        for e in examples
    ]
    return {
        "input_ids": torch.tensor([e.tokens + [pad] * (width - len(e.tokens)) for e in examples]),
        "attention_mask": torch.tensor(
            [[1] * len(e.tokens) + [0] * (width - len(e.tokens)) for e in examples]
        ),
        "labels": torch.tensor(labels)[:, keep_from:],
        "logits_to_keep": width - keep_from,
    }


def lora_config(adapter: AdapterRecipe, invocation: list[int] | None) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        task_type="CAUSAL_LM",
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=list(adapter.target_modules),
        bias="none",
        alora_invocation_tokens=invocation,
    )


def train_adapter(
    adapter: AdapterRecipe, base: BaseModel, folder: Path, steps: int | None = None
) -> TrainResult:
    """Train `adapter` on `base` and save it into `folder` (created); `steps` overrides the
    recipe's step count. The base model is left as it was (LoRA layers removed, requires_grad
    flags restored)."""
    from peft import get_peft_model

    steps = adapter.steps if steps is None else steps
    started = time.perf_counter()
    invocation = (
        invocation_tokens(base.tokenizer, adapter.invocation_text)
        if adapter.invocation_text is not None
        else None
    )
    answers = generate_answers(
        base, adapter.persona.system_prompt, adapter.questions, adapter.answer_tokens
    )
    examples = training_examples(adapter, base.tokenizer, answers, invocation)

    requires_grad = [p.requires_grad for p in base.model.parameters()]
    torch.manual_seed(adapter.seed)
    model = get_peft_model(base.model, lora_config(adapter, invocation))
    try:
        model.eval()  # no dropout anywhere; gradients flow regardless of the mode
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=adapter.learning_rate)
        loss_value = float("nan")
        for step in batches(adapter, len(examples), steps):
            batch = collate([examples[i] for i in step], base.tokenizer.pad_token_id)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_value = float(loss.detach())
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
    finally:
        model.unload()
        for parameter, flag in zip(base.model.parameters(), requires_grad, strict=True):
            parameter.requires_grad_(flag)
    return TrainResult(steps, loss_value, time.perf_counter() - started, invocation)
