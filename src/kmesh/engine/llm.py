"""Text in, text out: the reference engine with the model's tokenizer and chat template."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kmesh.compute.loader import LoadedModel, load_model
from kmesh.engine.engine import Engine
from kmesh.engine.request import Request, RequestOutput, SamplingParams
from kmesh.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    output: RequestOutput


def check_prompt_text(prompt: str) -> None:
    """Refuse a prompt with no text before any work is done on it."""
    if not prompt.strip():
        raise InvalidRequestError("the prompt is empty: give some text to complete")


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat messages in the model's chat template, ending with the prompt for the
    assistant's reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class LLM:
    """The reference engine over a loaded model (the embedded default model when none is given)."""

    def __init__(self, model: str | Path | LoadedModel | None = None, **engine_options: Any):
        self.model = model if isinstance(model, LoadedModel) else load_model(model)
        self.tokenizer = self.model.tokenizer
        self.engine = Engine(
            self.model.executor,
            self.model.fingerprint,
            decode=self.tokenizer.decode,
            **engine_options,
        )
        self._next_id = 0

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of a plain prompt, or of one user message in the model's chat template."""
        check_prompt_text(prompt)
        if chat:
            return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        tenant_salt: str | None = None,
    ) -> list[Completion]:
        """Complete the prompts together, in one batch where they fit."""
        params = params or SamplingParams()
        requests = []
        for prompt in prompts:
            requests.append(
                Request(
                    f"req-{self._next_id}",
                    tuple(self.encode(prompt, chat=chat)),
                    params,
                    tenant_salt,
                )
            )
            self._next_id += 1
        outputs = self.engine.generate(requests)
        return [Completion(self.decode(out.output_ids), out) for out in outputs]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
