"""A controlled All-Gather workload: N agents, R rounds, every agent sees every output.

Round r's prompt for agent a, as explicit segments (chat-formatted, one segment per message):
    system (shared, the same for all agents)
    persona + private notes of agent a (private; lengths differ between agents)
    for each earlier round: the N outputs of that round (shared), in agent a's order
    the round's instruction for agent a (instruction) + the generation prompt
An output segment is a fixed header ("Member k said:") plus the exact token ids its author
generated, so the KV of those tokens already exists in the author's context. Each agent's prompt
minus its instruction is an exact prefix of its next prompt (the temporal reuse prefix caching
gets); the outputs at per-agent offsets and orders are the sibling redundancy.

Outputs are generated with the reference engine on the real model, greedy by default, so a trace
is deterministic in (model, config) and benchmarks replay exactly the same prompts.
"""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kmesh.errors import InvalidRequestError
from kmesh.state.segments import Role, Segment, SegmentedPrompt
from kmesh.workloads.chatml import ChatML

if TYPE_CHECKING:  # the reference engine (and torch): only where a caller hands one in
    from kmesh.engine.engine import Engine

ORDERS = ("same", "rotate", "shuffle")

SYSTEM = (
    "You are one member of a town council. The council must decide how to spend a one-time "
    "grant of 2 million dollars. Each round, every member reads what all members said and then "
    "gives a short proposal or vote."
)
PERSONAS = (
    ("a retired school teacher", "You care about libraries and after-school programs."),
    ("a small business owner", "You want the main street repaved and parking fixed."),
    ("a nurse at the clinic", "The clinic is understaffed and its equipment is old."),
    ("a young parent", "The playground is unsafe and daycare is too expensive."),
    ("a farmer", "Flooding ruined two harvests; drainage is your priority."),
    ("a firefighter", "The fire station needs a new truck and radios."),
    ("a software developer", "You want public wifi and a coworking space."),
    ("a pastor", "Homeless residents need a shelter before winter."),
    ("an environmental scientist", "The river is polluted and the wetlands are shrinking."),
    ("a bus driver", "The bus routes skip the poorer neighbourhoods."),
    ("a high school student", "Young people have nowhere to go in the evenings."),
    ("a retired engineer", "The old bridge failed its last inspection."),
    ("a librarian", "The library roof leaks and the books are getting damaged."),
    ("a police officer", "Street lighting is poor and break-ins are rising."),
    ("an artist", "The town has no theatre or gallery and talent moves away."),
    ("an accountant", "The town already carries debt; saving part of the grant is prudent."),
)
NOTES = (
    "Last year you led a petition that gathered three hundred signatures.",
    "You have lived in the town for forty years and remember the last grant being wasted.",
    "Your neighbours often ask you to speak for them at meetings.",
    "You have read the budget report twice and marked every line you disagree with.",
)


@dataclass(frozen=True, slots=True)
class AllGatherConfig:
    agents: int
    rounds: int
    order: str = "shuffle"
    seed: int = 0
    output_tokens: int = 48

    def __post_init__(self) -> None:
        if self.agents < 2 or self.rounds < 1 or self.output_tokens < 1:
            raise InvalidRequestError(
                "an All-Gather workload needs --agents >= 2, --rounds >= 1 and output tokens >= 1"
            )
        if self.order not in ORDERS:
            raise InvalidRequestError(f"--order must be one of {ORDERS}, got {self.order!r}")


@dataclass(frozen=True, slots=True)
class AgentTurn:
    """One agent's prompt in one round, and what it answered."""

    round: int
    agent: int
    prompt: SegmentedPrompt
    output_ids: tuple[int, ...]
    output_text: str


def group_rounds(turns: Sequence[AgentTurn]) -> list[list[AgentTurn]]:
    """The turns by round (index = round), each round's in agent order."""
    rounds: list[list[AgentTurn]] = []
    for turn in sorted(turns, key=lambda t: (t.round, t.agent)):
        while len(rounds) <= turn.round:
            rounds.append([])
        rounds[turn.round].append(turn)
    return rounds


def new_tokens(rounds: Sequence[Sequence[AgentTurn]]) -> list[int]:
    """Per round, the tokens new to the system: those of the distinct segments (by tokens) of its
    prompts that no earlier round's prompt held, each counted once however many agents read it
    (in round r: round r - 1's outputs and the instructions; in round 0 everything)."""
    seen: set[tuple[int, ...]] = set()
    counts = []
    for turns in rounds:
        fresh = {s.token_ids for t in turns for s in t.prompt.segments} - seen
        counts.append(sum(len(tokens) for tokens in fresh))
        seen |= fresh
    return counts


def output_segment_id(round_index: int, agent: int) -> str:
    """The segment id of `agent`'s output in round `round_index`, the same in every prompt."""
    return f"out-{round_index}-{agent}"


def order_for(cfg: AllGatherConfig, round_index: int, agent: int) -> list[int]:
    """The order in which `agent` reads the round's outputs."""
    authors = list(range(cfg.agents))
    if cfg.order == "rotate":
        return authors[agent:] + authors[:agent]
    if cfg.order == "shuffle":
        random.Random(f"{cfg.seed}/{round_index}/{agent}").shuffle(authors)
    return authors


def persona_text(agent: int) -> str:
    """Agent `agent`'s persona and private notes (notes of different lengths)."""
    who, concern = PERSONAS[agent % len(PERSONAS)]
    # Private histories of different lengths: agent a gets (a % 4) + 1 notes.
    notes = " ".join(NOTES[: agent % len(NOTES) + 1])
    return f"You are member {agent + 1}, {who}. {concern} {notes}"


class Council:
    """The council's prompts round by round, each round built from the outputs given for the
    earlier ones: the trace generator feeds it the reference engine's outputs, a closed-loop
    benchmark the outputs each strategy generated itself."""

    def __init__(self, cfg: AllGatherConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self._chat = chat = ChatML(tokenizer)
        self._system = chat.opening_segment("system", SYSTEM, Role.SHARED, "system")
        self._personas = [
            chat.message_segment("user", persona_text(a), Role.PRIVATE, f"persona-{a}")
            for a in range(cfg.agents)
        ]
        self._history: list[list[Segment]] = []  # per earlier round: output segments by author

    def prompts(self) -> list[SegmentedPrompt]:
        """The next round's prompt of every agent."""
        r = len(self._history)
        chat = self._chat
        prompts = []
        for a in range(self.cfg.agents):
            segments = [self._system, self._personas[a]]
            for past, said in enumerate(self._history):
                segments += [said[author] for author in order_for(self.cfg, past, a)]
            ask = f"Round {r + 1}. Member {a + 1}, give your proposal in one or two sentences."
            segments.append(chat.instruction_segment(ask, f"ask-{r}-{a}"))
            prompts.append(SegmentedPrompt.of(segments))
        return prompts

    def answer(
        self, prompts: Sequence[SegmentedPrompt], outputs: Sequence[Sequence[int]]
    ) -> list[AgentTurn]:
        """Record the round's outputs (by agent) for the prompts `prompts()` gave; its turns."""
        r = len(self._history)
        chat = self._chat
        newline = chat.tokens("\n")
        turns = []
        said = []
        for a, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            output_ids = tuple(output)
            text = chat.decode(output_ids)
            turns.append(AgentTurn(r, a, prompt, output_ids, text))
            body = chat.closed(output_ids)
            header = chat.tokens(f"<|im_start|>user\nMember {a + 1} said: ")
            said.append(
                Segment(header + body + newline, Role.SHARED, output_segment_id(r, a), text, "user")
            )
        self._history.append(said)
        return turns


def generate_trace(
    cfg: AllGatherConfig,
    engine: "Engine",
    tokenizer: Any,
    progress: Callable[[str], None] = lambda _: None,
) -> list[AgentTurn]:
    """Run the council with the engine: every round's prompts, then every agent's output."""
    from kmesh.engine.request import Request, SamplingParams

    council = Council(cfg, tokenizer)
    params = SamplingParams(max_tokens=cfg.output_tokens)
    turns: list[AgentTurn] = []
    for r in range(cfg.rounds):
        progress(f"round {r + 1}/{cfg.rounds}: {cfg.agents} agents")
        prompts = council.prompts()
        outputs = engine.generate(
            Request(f"r{r}-a{a}", p.token_ids, params) for a, p in enumerate(prompts)
        )
        turns += council.answer(prompts, [out.output_ids for out in outputs])
    return turns
