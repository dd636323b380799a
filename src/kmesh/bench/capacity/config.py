"""`kmesh bench capacity`'s settings: agent counts, rounds, the memory budget, the workload and
its strategies (bench/capacity/run.py says what each strategy is); checked when made."""

from dataclasses import dataclass

from kmesh.errors import InvalidRequestError

STRATEGIES = (
    "vanilla",
    "vanilla_offload",
    "kmesh_dense",
    "kmesh",
    "kmesh_lru",
    "kmesh_vllm",
    "kmesh_vllm_lru",
)
WORKLOADS = ("allgather", "trajectory")
# Trajectories hold no masters: every piece is dense, so kmesh_dense would be kmesh.
TRAJECTORY_STRATEGIES = ("vanilla", "vanilla_offload", "kmesh", "kmesh_lru")
# max_agents: every round within this many times its new tokens (a trajectory's: its append).
LIMITS = {"allgather": 2.0, "trajectory": 1.5}


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    agents: tuple[int, ...] = (4, 8, 16, 32)
    rounds: int = 3
    budget_mib: int = 512
    order: str = "shuffle"
    seed: int = 0
    output_tokens: int = 48
    agent_ratio: float = 0.0
    workload: str = "allgather"
    tool_tokens: int = 256  # trajectory: a tool result's tokens
    strategies: tuple[str, ...] = ()  # () for every strategy of the workload

    def __post_init__(self) -> None:
        if not self.agents or min(self.agents) < 2:
            raise InvalidRequestError("--agents needs agent counts of at least 2, like 4,8,16")
        if self.rounds < 2:
            raise InvalidRequestError("--rounds must be at least 2 (state held between rounds)")
        if self.budget_mib < 1:
            raise InvalidRequestError("--budget-mib must be at least 1")
        if self.workload not in WORKLOADS:
            raise InvalidRequestError(f"--workload must be one of {', '.join(WORKLOADS)}")
        allowed = TRAJECTORY_STRATEGIES if self.workload == "trajectory" else STRATEGIES
        unknown = set(self.strategies) - set(allowed)
        if unknown or (self.strategies and "vanilla" not in self.strategies):
            raise InvalidRequestError(
                f"--strategies must include vanilla (its rounds are the trace) and name only "
                f"{', '.join(allowed)} for the {self.workload} workload; got "
                f"{', '.join(self.strategies)}"
            )

    @property
    def chosen(self) -> tuple[str, ...]:
        if self.strategies:
            return self.strategies
        return TRAJECTORY_STRATEGIES if self.workload == "trajectory" else STRATEGIES

    @property
    def limit(self) -> float:
        return LIMITS[self.workload]

    @property
    def budget_bytes(self) -> int:
        return self.budget_mib << 20
