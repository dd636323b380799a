"""Task accuracy of `kmesh bench agents --workload tasks`: what the agents' replies got right.

A reply to round r >= 1 answers TaskCouncil's ask, "write the record of round r": it holds an
item per member of round r - 1, right when `extract_record(reply)` gives that member's number
(as text). Greedy decoding under plain vLLM's prefix caching is exact, so the vllm strategy's
replies are full prefill's: a strategy is compared with them on the same items (paired by round,
agent and member), as bench/tasks/stats.py compares a strategy with full prefill. Pure functions
of the texts, no server.
NOTE: a whole record is about 7.5 tokens per member in the embedded model's tokenizer (65 for 8
members): a `--max-tokens` below that cuts every strategy's records alike, lowering accuracy but
not what retention compares.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kmesh.bench.tasks.stats import retention, retention_interval
from kmesh.workloads.tasks import NAMES, Said, extract_record


@dataclass(frozen=True, slots=True)
class RecordItem:
    """One member's number in one agent's record of the previous round."""

    round: int
    agent: str
    member: int
    answer: str | None  # None: the reply says no number for the member
    truth: str

    @property
    def correct(self) -> bool:
        return self.answer == self.truth


def record_items(
    facts: Sequence[Sequence[Said]], texts: Sequence[Mapping[str, str]]
) -> list[RecordItem]:
    """Every item of a run's replies (texts: per round, agent -> reply), by round from 1, agent
    name and member."""
    items = []
    for r in range(1, len(texts)):
        for agent, reply in sorted(texts[r].items()):
            found = extract_record(reply)
            items += [
                RecordItem(r, agent, s.member, found.get(NAMES[s.member]), str(s.number))
                for s in facts[r - 1]
            ]
    return items


def task_scores(
    facts: Sequence[Sequence[Said]],
    texts: Sequence[Mapping[str, str]],
    vllm_texts: Sequence[Mapping[str, str]],
) -> dict[str, Any]:
    """A strategy's run against the vllm strategy's on the same items: task_items,
    task_accuracy, task_retention (accuracy over vllm's; None where vllm got nothing right) and
    its paired bootstrap task_retention_ci, task_agreement (share of items whose answer is
    vllm's). ValueError if the runs' replies are not to the same calls."""
    ours = record_items(facts, texts)
    theirs = record_items(facts, vllm_texts)
    if [(i.round, i.agent) for i in ours] != [(i.round, i.agent) for i in theirs]:
        raise ValueError("a strategy's run and vllm's must hold replies to the same calls")
    if not ours:
        raise ValueError("no reply to score: the tasks workload scores rounds from 1 on")
    right = [i.correct for i in ours]
    full = [i.correct for i in theirs]
    interval = retention_interval(full, right)
    agree = [a.answer == b.answer for a, b in zip(ours, theirs, strict=True)]
    return {
        "task_items": len(right),
        "task_accuracy": sum(right) / len(right),
        "task_retention": retention(full, right),
        "task_retention_ci": None if interval is None else list(interval),
        "task_agreement": sum(agree) / len(agree),
    }
