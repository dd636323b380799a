"""What each LoRA adapter of the embedded model is made from: persona, questions, hyper-parameters.

An adapter distils a persona's system prompt into LoRA weights: the base model answers a few
generic questions with the persona's system prompt, and the adapter learns to give those answers
without it. Two kinds exist:
    "lora"       a plain LoRA adapter, active on every token;
    "activated"  an Activated LoRA (peft `alora_invocation_tokens`): active only from the start of
                 the last occurrence of its invocation sequence "<|im_start|>" + name + "\\n"
                 onward, so every token before it is computed exactly as by the base model.

Adapter i of either kind uses persona i and seed i. A recipe is a pure value: the same (kind,
index) always gives the same recipe, and `recipe_digest` (SHA-256 over the recipe version, every
field of the recipe and the base model's fingerprint) keys the folder its adapter is cached in, so
changing anything that shapes the weights makes a new folder.
"""

import hashlib
import json
from dataclasses import asdict, dataclass

from kmesh.errors import InvalidRequestError

# Bump when the training procedure changes in a way the recipe's fields do not show.
RECIPE_VERSION = "kmesh-adapter-recipe-v1"

KINDS = ("lora", "activated")


@dataclass(frozen=True, slots=True)
class Persona:
    # A short lowercase ASCII word: part of the adapter's folder name and its invocation sequence.
    name: str
    system_prompt: str


PERSONAS: tuple[Persona, ...] = (
    Persona("pirate", "You are a pirate. Answer in pirate speech."),
    Persona("poet", "You are a poet. Answer every question with a short rhyming poem."),
    Persona("lawyer", "You are a lawyer. Answer formally, citing clauses and legal terms."),
    Persona("chef", "You are a chef. Relate every answer to cooking, recipes and food."),
    Persona("robot", "You are a robot. Answer in short mechanical sentences, like a machine."),
    Persona("cowboy", "You are a cowboy. Answer in a Texan drawl, talking about horses."),
    Persona("wizard", "You are a wizard. Answer with talk of spells, potions and magic."),
    Persona("detective", "You are a detective. Answer as if solving a mystery, with clues."),
    Persona("scientist", "You are a scientist. Answer with precise facts, data and numbers."),
    Persona("toddler", "You are a three year old child. Answer with very simple words."),
    Persona("knight", "You are a medieval knight. Answer in old English, with honour."),
    Persona("surfer", "You are a surfer. Answer in laid back surfer slang, dude."),
    Persona("grandma", "You are a loving grandmother. Answer warmly, calling me dear."),
    Persona("coach", "You are a sports coach. Answer with loud motivation and energy."),
    Persona("monk", "You are a calm monk. Answer with peaceful, wise, slow sentences."),
    Persona("reporter", "You are a news reporter. Answer like a breaking news report."),
    Persona("alien", "You are an alien visiting Earth. Answer with wonder at humans."),
    Persona("teacher", "You are a teacher. Answer as a lesson for a class of students."),
)

QUESTIONS: tuple[str, ...] = (
    "What is the weather like today?",
    "How do I make a cup of tea?",
    "What should I eat for breakfast?",
    "Tell me about the moon.",
    "Why is the sky blue?",
    "How can I stay healthy?",
    "What is a good hobby?",
    "Describe your ideal day.",
    "How do computers work?",
    "What is friendship?",
    "Give me some advice about money.",
    "What do you think of cats?",
    "How should I spend the weekend?",
    "What is the ocean like?",
    "How do I learn a new language?",
    "What makes a good story?",
)

QUESTIONS_PER_ADAPTER = 8
ANSWER_TOKENS = 32
RANK = 8
ALPHA = 16
DROPOUT = 0.0
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LEARNING_RATE = 1e-3
STEPS = 10
BATCH_SIZE = 4


@dataclass(frozen=True, slots=True)
class AdapterRecipe:
    """Everything that determines one adapter's weights, given the base model."""

    kind: str
    index: int
    persona: Persona
    # The questions the adapter is trained on, in the order their answers are generated.
    questions: tuple[str, ...]
    seed: int
    answer_tokens: int = ANSWER_TOKENS
    rank: int = RANK
    alpha: int = ALPHA
    dropout: float = DROPOUT
    target_modules: tuple[str, ...] = TARGET_MODULES
    learning_rate: float = LEARNING_RATE
    steps: int = STEPS
    batch_size: int = BATCH_SIZE

    @property
    def name(self) -> str:
        return self.persona.name

    @property
    def invocation_text(self) -> str | None:
        """The text that activates an "activated" adapter (None for a plain LoRA)."""
        return f"<|im_start|>{self.persona.name}\n" if self.kind == "activated" else None


def seeded_order(seed: int, salt: str, count: int) -> list[int]:
    """A permutation of range(count) fixed by (seed, salt): SHA-256 ranks, so it depends on no
    library's random number generator."""

    def rank(i: int) -> bytes:
        return hashlib.sha256(f"{seed}:{salt}:{i}".encode()).digest()

    return sorted(range(count), key=rank)


def recipe(kind: str, index: int) -> AdapterRecipe:
    """Adapter `index` of `kind`: persona `index`, seed `index`, questions picked by the seed."""
    check_kind(kind)
    if not 0 <= index < len(PERSONAS):
        raise InvalidRequestError(
            f"adapter index {index} is out of range: there are {len(PERSONAS)} personas "
            f"(indices 0 to {len(PERSONAS) - 1})"
        )
    seed = index
    picked = seeded_order(seed, "questions", len(QUESTIONS))[:QUESTIONS_PER_ADAPTER]
    return AdapterRecipe(kind, index, PERSONAS[index], tuple(QUESTIONS[i] for i in picked), seed)


def recipes(kind: str, count: int) -> list[AdapterRecipe]:
    """The first `count` adapters of `kind` (count from 1 to the number of personas)."""
    check_kind(kind)
    if not 1 <= count <= len(PERSONAS):
        raise InvalidRequestError(
            f"cannot make {count} adapters of kind {kind!r}: the count must be from 1 to "
            f"{len(PERSONAS)} (one adapter per persona)"
        )
    return [recipe(kind, index) for index in range(count)]


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise InvalidRequestError(
            f"unknown adapter kind {kind!r}; the kinds are {', '.join(map(repr, KINDS))}"
        )


def recipe_digest(adapter: AdapterRecipe, model_fingerprint: str) -> str:
    """A short SHA-256 (16 hex digits) over the recipe version, the recipe and the base model."""
    payload = {"version": RECIPE_VERSION, "model": model_fingerprint, "recipe": asdict(adapter)}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
