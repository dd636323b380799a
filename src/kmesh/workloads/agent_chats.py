"""The agents of `kmesh bench agents` as chat conversations: what an agent framework sends.

Every message has an id and a role (shared or private), which KMesh strategies declare in
`kmesh.messages` and plain vLLM never sees. Outputs come from the server under test (closed
loop): `answer(texts)` records a round's outputs, and the next round's calls read them.

- allgather (the lab's council, workloads/allgather.py, as chat): round r of agent a is
      system    SYSTEM, the same for every agent                      "system"      shared
      user      persona_text(a)                                       "persona-a"   private
      user      BRIEFING, the same for every agent                    "briefing"    shared
      for each earlier round q, every agent k's output in a's order (order_for):
      user      "Member k+1 said: TEXT"                               "out-q-k"     shared
      user      the round's instruction (not kept in the history)     "ask-r-a"     private
  All agents of a round are sent at once; a round reads the previous round's outputs.
- trajectory (workloads/trajectory.py's coding agents, with a long start): turn t of agent a is
      system    trajectory.SYSTEM                                     "system"      shared
      user      its task and a repository listing of context_tokens   "context-a"   shared
      for each earlier turn i: its step (assistant, "step-i-a", private), then the tool's
      result to it (user, tool_tokens, "tool-i-a", private)
  Agent a's turn is sent `stagger_s * (a + u)` seconds into the round (u seeded in [0, 1)).
- mixed: both on one server, half the agents each (at least 2 All-Gather agents and 1
  trajectory), plus agents // 4 plain one-off chats per round (no history).
- tasks (workloads/tasks.py's council with ground truth, as chat): allgather's calls, ids and
  reading orders, with tasks.SYSTEM, tasks.persona_text(a) and no briefing. What every agent
  reads of round q is that round's composed messages (task_facts: "NAME said: ...", "out-q-k"),
  never the replies, so the facts stay known; the ask is tasks.ask_text (from round 1 on: write
  the record of round r - 1). The replies are what bench/agents/task_scores.py scores. The code
  words are WORDS as is: only the task bench's forced choice needs them one token each, and
  nothing here scores them.

Each call's messages minus its last (the instruction or the tool's result still to answer) stay
a prefix of that agent's next call: the reuse prefix caching gets.
"""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kmesh.errors import InvalidRequestError
from kmesh.workloads import allgather, tasks, trajectory
from kmesh.workloads.allgather import AllGatherConfig, order_for

WORKLOADS = ("allgather", "trajectory", "mixed", "tasks")
BRIEFING = (
    "Briefing from the town clerk. The grant arrives in March and must be committed by the end "
    "of June; money not committed by then goes back to the state. The council has already "
    "promised two hundred thousand dollars to repair the water main on Elm Street, so one point "
    "eight million is left. Last winter the clinic turned away forty patients a week, the fire "
    "truck failed two inspections, the library roof leaked onto the archive, and the bus to the "
    "east side ran only twice a day. The bridge on Mill Road is closed to trucks. Residents sent "
    "three hundred letters; most asked for safer streets, better care for the old and the sick, "
    "and something for the young. The council votes after three rounds of discussion."
)
PLAIN_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for writing clear emails.",
    "Explain what a prime number is.",
    "Suggest a name for a bakery.",
    "How do plants make their food?",
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system, user or assistant
    content: str
    id: str
    shared: bool


@dataclass(frozen=True, slots=True)
class AgentCall:
    """One request of one agent in one round."""

    agent: str  # like "allgather-3", "trajectory-0", "plain-2-1"
    kind: str  # allgather (the tasks workload's council too), trajectory or plain
    messages: tuple[ChatMessage, ...]
    # Seconds after the round's start at which it is sent.
    delay_s: float
    # allgather from round 1 on: the ids of the previous round's outputs, in author order.
    round_outputs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AgentsConfig:
    workload: str
    agents: int
    rounds: int = 3
    seed: int = 0
    order: str = "shuffle"
    # trajectory: the listing each agent starts from, the tool's result per turn, the stagger.
    context_tokens: int = 6144
    tool_tokens: int = 64
    stagger_s: float = 0.5

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise InvalidRequestError(f"--workload must be one of {', '.join(WORKLOADS)}")
        if self.agents < 2 or self.rounds < 1:
            raise InvalidRequestError("the agents bench needs --agents >= 2 and --rounds >= 1")
        if self.workload == "tasks":
            self.tasks_config()  # its own checks: a name per agent, a round with a record to write
        if self.context_tokens < 16 or self.tool_tokens < 16 or self.stagger_s < 0:
            raise InvalidRequestError(
                "--context-tokens and --tool-tokens must be at least 16, --stagger at least 0"
            )

    def tasks_config(self) -> tasks.TasksConfig:
        """The tasks workload's council (its facts are drawn from it)."""
        return tasks.TasksConfig(self.agents, self.rounds, self.order, self.seed)

    @property
    def split(self) -> tuple[int, int, int]:
        """(All-Gather agents, trajectory agents, plain chats per round)."""
        if self.workload in ("allgather", "tasks"):
            return self.agents, 0, 0
        if self.workload == "trajectory":
            return 0, self.agents, 0
        gather = max(2, self.agents // 2)
        return gather, max(1, self.agents - gather), self.agents // 4


def task_facts(cfg: AgentsConfig) -> list[list[tasks.Said]]:
    """The tasks workload's facts, by round and member (module docstring: the code words)."""
    return [tasks.round_facts(cfg.tasks_config(), r, tasks.WORDS) for r in range(cfg.rounds)]


class AgentChats:
    """The calls of every round, built from the outputs `answer` recorded for the earlier ones."""

    def __init__(self, cfg: AgentsConfig, count_tokens: Callable[[str], Sequence[Any]]) -> None:
        self.cfg = cfg
        self.round = 0
        gather, agents, _ = cfg.split
        self._order = AllGatherConfig(max(2, gather), cfg.rounds, cfg.order, cfg.seed)
        self._said: list[list[ChatMessage]] = []  # per earlier round, by author
        self._facts = task_facts(cfg) if cfg.workload == "tasks" else []
        self._contexts = [
            ChatMessage(
                "user",
                f"{trajectory.TASKS[a % len(trajectory.TASKS)]} Repository listing:\n"
                + trajectory.tool_result(cfg.seed, a, -1, cfg.context_tokens, count_tokens),
                f"context-{a}",
                True,
            )
            for a in range(agents)
        ]
        self._steps: list[list[ChatMessage]] = [[] for _ in range(agents)]
        self._count = count_tokens

    def calls(self) -> list[AgentCall]:
        """This round's calls, the All-Gather agents first."""
        gather, agents, plain = self.cfg.split
        r = self.round
        calls = [self._gather_call(a) for a in range(gather)]
        rng = random.Random(f"{self.cfg.seed}/{r}")
        for a in range(agents):
            delay = self.cfg.stagger_s * (a + rng.random())
            system = ChatMessage("system", trajectory.SYSTEM, "system", True)
            messages = (system, self._contexts[a], *self._steps[a])
            calls.append(AgentCall(f"trajectory-{a}", "trajectory", messages, delay))
        for i in range(plain):
            question = PLAIN_QUESTIONS[(r + i) % len(PLAIN_QUESTIONS)]
            message = ChatMessage("user", f"{question} (request {r}-{i})", f"plain-{r}-{i}", False)
            calls.append(AgentCall(f"plain-{r}-{i}", "plain", (message,), rng.random()))
        return calls

    def _gather_call(self, a: int) -> AgentCall:
        r = self.round
        if self._facts:
            messages = [
                ChatMessage("system", tasks.SYSTEM, "system", True),
                ChatMessage("user", tasks.persona_text(a), f"persona-{a}", False),
            ]
            ask = tasks.ask_text(r, a)
        else:
            messages = [
                ChatMessage("system", allgather.SYSTEM, "system", True),
                ChatMessage("user", allgather.persona_text(a), f"persona-{a}", False),
                ChatMessage("user", BRIEFING, "briefing", True),
            ]
            ask = f"Round {r + 1}. Member {a + 1}, give your proposal in one or two sentences."
        for q, said in enumerate(self._said):
            messages += [said[k] for k in order_for(self._order, q, a)]
        messages.append(ChatMessage("user", ask, f"ask-{r}-{a}", False))
        outputs = tuple(m.id for m in self._said[-1]) if self._said else ()
        return AgentCall(f"allgather-{a}", "allgather", tuple(messages), 0.0, outputs)

    def answer(self, texts: dict[str, str]) -> None:
        """Record this round's outputs, by call agent name (tasks: its composed messages
        instead); the next round follows."""
        gather, agents, _ = self.cfg.split
        r = self.round
        if self._facts:
            said = [s.message for s in self._facts[r]]
        else:
            said = [f"Member {k + 1} said: {texts[f'allgather-{k}']}" for k in range(gather)]
        if said:
            self._said.append(
                [ChatMessage("user", text, f"out-{r}-{k}", True) for k, text in enumerate(said)]
            )
        for a in range(agents):
            result = trajectory.tool_result(self.cfg.seed, a, r, self.cfg.tool_tokens, self._count)
            self._steps[a] += [
                ChatMessage("assistant", texts[f"trajectory-{a}"], f"step-{r}-{a}", False),
                ChatMessage("user", result, f"tool-{r}-{a}", False),
            ]
        self.round += 1
