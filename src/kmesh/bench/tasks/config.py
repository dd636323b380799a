"""The task bench's settings (bench/tasks/run.py): budgets, selections and the accuracy gate;
checked on construction, each error naming its flag. Torch-free: the command line builds it to
parse its flags."""

from dataclasses import dataclass
from typing import get_args

from kmesh.errors import InvalidRequestError
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.workloads.tasks import TASKS

# The recovery policies that choose rows (a request's `recovery.policy`, the same list as
# recovery/policies.py's POLICIES), without `none` and `full`.
SELECTING = tuple(
    p for p in get_args(RecoverySpec.model_fields["policy"].annotation) if p not in ("none", "full")
)
# Selections measured (the default is collective's and per_request's); each a recovery policy.
SELECTIONS = ("first_k", "query", "kv_deviation", "first_k+query")
# Chosen on a sweep of every selection and checked on other seeds, agent counts and a second
# model (docs/guide/quality.md, "The default selection").
DEFAULT_SELECTION = "first_k"


@dataclass(frozen=True, slots=True)
class TasksBenchConfig:
    budgets: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3)
    selections: tuple[str, ...] = SELECTIONS
    default_selection: str = DEFAULT_SELECTION
    accuracy_gate: float = 0.7
    tasks: tuple[str, ...] = TASKS
    per_request: bool = True

    def __post_init__(self) -> None:
        if not self.budgets or any(not 0.0 <= b < 1.0 for b in self.budgets):
            raise InvalidRequestError("--budgets must be shares in [0, 1), like 0,0.1,0.2")
        for selection in (*self.selections, self.default_selection):
            if selection not in SELECTING:
                raise InvalidRequestError(
                    f"selection {selection!r} is not a selecting recovery policy; choose from "
                    f"{', '.join(SELECTING)}"
                )
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown or not self.tasks:
            raise InvalidRequestError(f"--tasks takes some of {', '.join(TASKS)}; got {unknown}")
        if not 0.0 <= self.accuracy_gate <= 1.0:
            raise InvalidRequestError("--accuracy-gate must be between 0 and 1")
