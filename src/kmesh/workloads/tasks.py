"""All-Gather rounds with ground truth: what `kmesh bench tasks` scores.

A council of N members meets for R rounds. Every message is composed from the seed (no model
writes it), so its facts are known: member k's message in round r says, among filler drawn from
the seed, the number k proposes (two digits, distinct within the round), its code word (one
token in the model's tokenizer, distinct within the round) and its vote (one of OPTIONS, one
option winning outright). Round r's prompt for member a is the All-Gather prompt of
workloads/allgather.py with these messages in place of generated outputs:
    system (shared) · a's persona (private) · every earlier round's messages in a's order
    (workloads/allgather.py::order_for; each "NAME said: ...", shared, the segment id of an
    output) · the round's instruction (private) + the generation prompt.
From round 1 on, each turn carries probes on the previous round's messages (the ones a reuse
strategy has just placed), each a continuation of the turn's prompt inside the assistant's reply:
- record_reading: "Record of round r: NAME proposes NN lanterns. ..." in a's reading order, teacher
  forced: an item per member, right when the top-1 token at each of its number's tokens is the
  truth;
- record_members: "Members' record of round r: ..." in member order (another order than a
  read them);
- record_free: "Minutes of round r:" and greedy generation; an item per member, right when the
  first number written after its name (on the same line, before another name) is the truth;
- lookup: "Lookup for round r: NAME's code word is" (LOOKUPS members per turn, drawn from the
  seed): forced choice over the round's code words by their log-likelihood (one token each);
- aggregate: "Vote of round r: the vote was won by": forced choice over OPTIONS.
Each task's tail starts with a word of its own, so that no probe's tail shares a whole page with
another probe's of the turn: an engine's prefix cache would otherwise give one probe the other's
rows, and a teacher-forced position needs the row before it computed by its own request.
`kmesh bench agents --workload tasks` sends these messages as chat (workloads/agent_chats.py) and
scores the replies' records (bench/agents/task_scores.py).
"""

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kmesh.errors import InvalidRequestError
from kmesh.state.segments import Role, Segment, SegmentedPrompt
from kmesh.workloads.allgather import AgentTurn, AllGatherConfig, order_for, output_segment_id
from kmesh.workloads.chatml import ChatML

TASKS = ("record_reading", "record_members", "record_free", "lookup", "aggregate")
# Probe kinds: teacher forced (per-position distributions over the tail), a choice among
# one-token candidates (the distribution after the tail), free-running generation.
KINDS = {
    "record_reading": "forced",
    "record_members": "forced",
    "record_free": "free",
    "lookup": "choice",
    "aggregate": "choice",
}
LOOKUPS = 2
OPTIONS = ("north", "south", "east", "west")
NAMES = (
    "Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena",
    "Max", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Will", "Yara",
)  # fmt: skip
WORDS = (
    "red", "blue", "green", "black", "white", "gold", "silver", "brown", "pink", "grey", "apple",
    "river", "stone", "cloud", "tiger", "eagle", "horse", "maple", "cedar", "lemon", "olive",
    "violet", "amber", "coral", "ivory", "copper", "iron", "salt", "wolf", "bear", "fox", "owl",
    "hawk", "crow", "oak", "pine", "elm", "ash", "birch", "rose", "lily", "bridge", "market",
    "school", "park",
)  # fmt: skip
SYSTEM = (
    "You are one member of a town council, and its clerk. Each round every member states a "
    "number of lanterns to buy, a code word for the storeroom and a vote for the road to pave "
    "first. Each round you read every member's message, write the record of the last round "
    "exactly as the members said it, then give your own proposal."
)
FILLER = (
    "The storm last week knocked down two poles on the harbour road.",
    "I walked the whole east side on Sunday and counted the dark corners.",
    "The shop owners asked me to keep the cost low this year.",
    "Our neighbours say the square is too dark after eight in the evening.",
    "The old lanterns rust quickly because of the salt in the air.",
    "I spoke with the smith, who can mend some of the frames.",
    "Children walk home from the school along the canal in winter.",
    "The market hall wants light on both of its doors.",
    "The treasurer warned that the oil price may rise in spring.",
    "Last year we bought too few and had to order again in autumn.",
    "The bridge keeper lights his own lamp, but it is not enough.",
    "I think we should not repeat the quarrel of the last meeting.",
)
# A member's number in a generated record: its name, then within a few characters that are
# neither digits nor the next name's capital ("Ann proposes 47", "Ann: 47", "Ann, 47 lanterns").
RECORD = re.compile(r"([A-Z][a-z]+)[^0-9A-Z\n]{0,20}?(\d+)")


@dataclass(frozen=True, slots=True)
class TasksConfig:
    agents: int = 8
    rounds: int = 3
    order: str = "shuffle"
    seed: int = 0
    # Filler sentences around the facts in each message.
    filler: int = 3

    def __post_init__(self) -> None:
        if not 2 <= self.agents <= len(NAMES):
            raise InvalidRequestError(
                f"--agents must be between 2 and {len(NAMES)} (one name each)"
            )
        if self.rounds < 2:
            raise InvalidRequestError("--rounds must be at least 2 (round 0 holds no messages)")
        if not 0 <= self.filler <= len(FILLER):
            raise InvalidRequestError(f"--filler must be between 0 and {len(FILLER)}")
        AllGatherConfig(self.agents, self.rounds, self.order, self.seed)  # checks the order

    @property
    def council(self) -> AllGatherConfig:
        return AllGatherConfig(self.agents, self.rounds, self.order, self.seed)


@dataclass(frozen=True, slots=True)
class Said:
    """Member `member`'s facts in one round."""

    member: int
    number: int
    word: str
    vote: str
    text: str

    @property
    def message(self) -> str:
        """What the others read of it: "NAME said: TEXT"."""
        return f"{NAMES[self.member]} said: {self.text}"


@dataclass(frozen=True, slots=True)
class Item:
    """One scored answer of a probe. forced: `positions` index the probe's tail (the tail token
    there is predicted by the row before it) and `truth` is the tokens there; choice: `truth` is
    one of `candidates` (one token each), predicted after the whole tail; free: `truth` is the
    number as text, found after `name` in the generated record."""

    key: str
    truth: tuple[int, ...] | str
    positions: tuple[int, ...] = ()
    candidates: tuple[int, ...] = ()
    name: str = ""


@dataclass(frozen=True, slots=True)
class Probe:
    task: str
    round: int
    agent: int
    tail: tuple[int, ...]
    items: tuple[Item, ...]

    @property
    def kind(self) -> str:
        return KINDS[self.task]


@dataclass(frozen=True, slots=True)
class TaskTurn:
    turn: AgentTurn
    probes: tuple[Probe, ...]


def round_facts(cfg: TasksConfig, r: int, words: Sequence[str]) -> list[Said]:
    """Round r's messages, by member: facts and filler drawn from (seed, r)."""
    rng = random.Random(f"tasks/{cfg.seed}/{r}")
    numbers = rng.sample(range(10, 100), cfg.agents)
    codes = rng.sample(list(words), cfg.agents)
    while True:  # one option wins outright
        votes = [rng.choice(OPTIONS) for _ in range(cfg.agents)]
        counts = sorted((votes.count(o) for o in OPTIONS), reverse=True)
        if counts[0] > counts[1]:
            break
    said = []
    for k in range(cfg.agents):
        filler = rng.sample(FILLER, cfg.filler)
        parts = [
            f"{NAMES[k]} proposes {numbers[k]} lanterns.",
            *filler[:1],
            f"{NAMES[k]}'s code word is {codes[k]}.",
            *filler[1:2],
            f"{NAMES[k]} votes {votes[k]}.",
            *filler[2:],
        ]
        said.append(Said(k, numbers[k], codes[k], votes[k], " ".join(parts)))
    return said


def persona_text(agent: int) -> str:
    return f"You are {NAMES[agent]}, member {agent + 1} of the council."


def ask_text(r: int, agent: int) -> str:
    """Round r's instruction to `agent`: from round 1 on, the record of round r - 1 first."""
    task = (
        "give your proposal."
        if r == 0
        else f"write the record of round {r}, then give your proposal."
    )
    return f"Round {r + 1}. {NAMES[agent]}, {task}"


def winner(said: Sequence[Said]) -> str:
    votes = [s.vote for s in said]
    return max(OPTIONS, key=votes.count)


def one_token_words(chat: ChatML) -> list[str]:
    """The code words that are one token after a space in the model's tokenizer."""
    return [w for w in WORDS if len(chat.tokens(f" {w}")) == 1]


class TaskCouncil:
    """Every turn's prompt (segments) and probes, from the config and the model's tokenizer."""

    def __init__(self, cfg: TasksConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.chat = chat = ChatML(tokenizer)
        self.words = one_token_words(chat)
        if len(self.words) < cfg.agents or any(len(chat.tokens(f" {o}")) != 1 for o in OPTIONS):
            raise InvalidRequestError(
                "this model's tokenizer splits too many of the task's code words or options into "
                "several tokens; the task bench needs one-token candidates"
            )
        self.rounds = [round_facts(cfg, r, self.words) for r in range(cfg.rounds)]

    def turns(self) -> list[TaskTurn]:
        chat, cfg = self.chat, self.cfg
        system = chat.opening_segment("system", SYSTEM, Role.SHARED, "system")
        personas = [
            chat.message_segment("user", persona_text(a), Role.PRIVATE, f"persona-{a}")
            for a in range(cfg.agents)
        ]
        said = [
            [
                Segment(
                    chat.message("user", s.message),
                    Role.SHARED,
                    output_segment_id(r, s.member),
                    s.text,
                    "user",
                )
                for s in round_
            ]
            for r, round_ in enumerate(self.rounds)
        ]
        turns = []
        for r in range(cfg.rounds):
            for a in range(cfg.agents):
                segments = [system, personas[a]]
                for q in range(r):
                    segments += [said[q][k] for k in order_for(cfg.council, q, a)]
                ask = ask_text(r, a)
                segments.append(chat.instruction_segment(ask, f"ask-{r}-{a}"))
                turn = AgentTurn(r, a, SegmentedPrompt.of(segments), (), "")
                turns.append(TaskTurn(turn, self.probes(r, a) if r else ()))
        return turns

    def probes(self, r: int, a: int) -> tuple[Probe, ...]:
        """Turn (r, a)'s probes on round r - 1's messages."""
        said = self.rounds[r - 1]
        reading = order_for(self.cfg.council, r - 1, a)
        probes = [
            self._record(
                "record_reading", r, a, f"Record of round {r}:", [said[k] for k in reading]
            ),
            self._record("record_members", r, a, f"Members' record of round {r}:", list(said)),
        ]
        free = tuple(
            Item(f"{r}/{a}/record_free/{s.member}", str(s.number), name=NAMES[s.member])
            for s in said
        )
        probes.append(Probe("record_free", r, a, self.chat.tokens(f"Minutes of round {r}:"), free))
        codes = tuple(self.chat.tokens(f" {s.word}")[0] for s in said)
        rng = random.Random(f"tasks/{self.cfg.seed}/{r}/{a}/lookup")
        for k in rng.sample(range(self.cfg.agents), min(LOOKUPS, self.cfg.agents)):
            item = Item(f"{r}/{a}/lookup/{k}", (codes[k],), candidates=codes)
            tail = self.chat.tokens(f"Lookup for round {r}: {NAMES[k]}'s code word is")
            probes.append(Probe("lookup", r, a, tail, (item,)))
        options = tuple(self.chat.tokens(f" {o}")[0] for o in OPTIONS)
        truth = options[OPTIONS.index(winner(said))]
        item = Item(f"{r}/{a}/aggregate", (truth,), candidates=options)
        tail = self.chat.tokens(f"Vote of round {r}: the vote was won by")
        probes.append(Probe("aggregate", r, a, tail, (item,)))
        return tuple(probes)

    def _record(self, task: str, r: int, a: int, head: str, said: list[Said]) -> Probe:
        """A teacher-forced record of `said` in that order; an item per member's number."""
        tail = list(self.chat.tokens(head))
        items = []
        for s in said:
            tail += self.chat.tokens(f" {NAMES[s.member]} proposes")
            number = self.chat.tokens(f" {s.number}")
            start = len(tail)
            tail += number
            # Only the digits are the fact: a leading space token (the tokenizer's, if it splits
            # one off) is format, not reading.
            digits = [i for i, t in enumerate(number) if self.chat.decode((t,)).isdigit()]
            positions = tuple(start + i for i in digits)
            truth = tuple(number[i] for i in digits)
            items.append(Item(f"{r}/{a}/{task}/{s.member}", truth, positions))
            tail += self.chat.tokens(" lanterns.")
        return Probe(task, r, a, tuple(tail), tuple(items))


def extract_record(text: str) -> dict[str, str]:
    """NAME -> the number a generated record says NAME proposes (the first mention)."""
    found: dict[str, str] = {}
    for name, number in RECORD.findall(text):
        found.setdefault(name, number)
    return found
