"""Agent trajectories: long context, short appends (DualPath's shape of agentic serving).

N agents each work on their own task for T turns. Turn t's prompt of agent a, as segments:
    system (shared, the same for all agents)
    the agent's task (private)
    for each earlier turn i: the agent's step i (an assistant message: the exact tokens it
    generated), then the tool's result i (a user message of about `tool_tokens` tokens of
    seeded, synthetic tool output)
    the generation prompt (instruction: the start of the next step)
Each prompt minus its generation prompt is an exact prefix of the next one, so a turn appends one
step and one tool result: a few hundred tokens onto a context that grows by that much per turn.
Turns are AgentTurn objects (workloads/allgather.py): `round` is the turn.
"""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kmesh.errors import InvalidRequestError
from kmesh.state.segments import Role, Segment, SegmentedPrompt
from kmesh.workloads.allgather import AgentTurn
from kmesh.workloads.chatml import ChatML

SYSTEM = (
    "You are a coding agent. Each turn you read the tool's last result and give your next step: "
    "one short action and why."
)
TASKS = (
    "Find why the nightly build of the billing service fails and fix it.",
    "Add retry with backoff to the payment client and test it.",
    "Make the search index rebuild incremental.",
    "Find the memory leak in the image resizer worker.",
    "Upgrade the logging library and fix every deprecation warning.",
    "Speed up the slowest report query by a factor of two.",
)
_FILES = ("api/routes.py", "core/models.py", "jobs/nightly.py", "lib/cache.py", "tests/test_io.py")
_EVENTS = ("ok", "warning: deprecated call", "error: timeout after 30s", "skipped", "2 failures")


@dataclass(frozen=True, slots=True)
class TrajectoryConfig:
    agents: int
    turns: int
    seed: int = 0
    output_tokens: int = 32
    tool_tokens: int = 256

    def __post_init__(self) -> None:
        if self.agents < 1 or self.turns < 2 or self.output_tokens < 1 or self.tool_tokens < 16:
            raise InvalidRequestError(
                "a trajectory workload needs agents >= 1, turns >= 2, output tokens >= 1 and "
                "tool tokens >= 16"
            )


class Trajectories:
    """The agents' prompts turn by turn, each built from the steps given for the earlier ones
    (like workloads/allgather.py::Council)."""

    def __init__(self, cfg: TrajectoryConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self._chat = chat = ChatML(tokenizer)
        self._system = chat.opening_segment("system", SYSTEM, Role.SHARED, "system")
        self._tasks = [
            chat.message_segment("user", TASKS[a % len(TASKS)], Role.PRIVATE, f"task-{a}")
            for a in range(cfg.agents)
        ]
        self._ask = chat.generation_prompt()
        self._history: list[list[Segment]] = [[] for _ in range(cfg.agents)]

    def prompts(self) -> list[SegmentedPrompt]:
        """The next turn's prompt of every agent."""
        t = len(self._history[0]) // 2
        ask = Segment(self._ask, Role.INSTRUCTION, f"ask-{t}", "", "assistant")
        return [
            SegmentedPrompt.of([self._system, self._tasks[a], *self._history[a], ask])
            for a in range(self.cfg.agents)
        ]

    def answer(
        self, prompts: Sequence[SegmentedPrompt], outputs: Sequence[Sequence[int]]
    ) -> list[AgentTurn]:
        """Record the turn's steps (by agent) and the tool's results to them; the turns."""
        t = len(self._history[0]) // 2
        newline = self._chat.tokens("\n")
        turns = []
        for a, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            output_ids = tuple(output)
            text = self._chat.decode(output_ids)
            turns.append(AgentTurn(t, a, prompt, output_ids, text))
            body = self._chat.closed(output_ids)
            step = Segment(
                self._ask + body + newline, Role.PRIVATE, f"step-{t}-{a}", text, "assistant"
            )
            result = tool_result(self.cfg.seed, a, t, self.cfg.tool_tokens, self._chat.tokens)
            tool = self._chat.message_segment("user", result, Role.PRIVATE, f"tool-{t}-{a}")
            self._history[a] += [step, tool]
        return turns


def tool_result(seed: int, agent: int, turn: int, tokens: int, count: Callable[[str], Any]) -> str:
    """About `tokens` tokens (as `count` tokenizes) of synthetic tool output, fixed by (seed,
    agent, turn)."""
    rng = random.Random(f"{seed}-{agent}-{turn}")
    lines = ["Tool result:"]
    while len(count("\n".join(lines))) < tokens:
        lines.append(
            f"{rng.choice(_FILES)}:{rng.randrange(1, 900)} {rng.choice(_EVENTS)} "
            f"({rng.randrange(1, 99)} ms)"
        )
    return "\n".join(lines)
