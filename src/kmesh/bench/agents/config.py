"""`kmesh bench agents`'s settings: workload, agent counts, strategies, SLO, servers' sizes.

Construction checks every field and raises InvalidRequestError with the flag to change, so the
CLI reports a bad value in one line before any server starts.
"""

from dataclasses import dataclass

from kmesh.compute.config import DTYPES
from kmesh.errors import InvalidRequestError
from kmesh.store.server import parse_size
from kmesh.workloads.agent_chats import AgentsConfig

STRATEGIES = ("vllm", "kmesh_exact", "kmesh_per_request", "kmesh_collective")
ENGINES = ("vllm", "reference")


@dataclass(frozen=True, slots=True)
class AgentsBenchConfig:
    """One `kmesh bench agents` run's settings (the CLI's flags); checked when made."""

    workload: str = "allgather"
    agents: tuple[int, ...] = (4, 8, 16, 32)
    rounds: int = 3
    seed: int = 0
    order: str = "shuffle"
    # The SLO on time to first token (p99 over a run's calls); docs/benchmarks.md, agents, says why
    # this value.
    slo_ttft_s: float = 10.0
    # Greedy tokens per message.
    max_tokens: int = 48
    engine: str = "vllm"
    strategies: tuple[str, ...] = STRATEGIES
    # Both servers' vLLM KV cache, and the KMesh store's capacity.
    kv_cache: str = "4G"
    store_capacity: str = "8G"
    # Both vLLM servers' dtype. float32: in bfloat16, what plain `vllm serve` picks itself for this
    # model here, vLLM's own greedy outputs change with the batch a call ran in, so no strategy can
    # be checked for identical messages (docs/design/performance.md, "The dtype"). The reference
    # engine computes in float32 whatever this says.
    dtype: str = "float32"
    # kmesh_per_request's recompute ratio; kmesh_collective's per-agent ratio.
    per_request_ratio: float = 0.3
    agent_ratio: float = 0.0
    context_tokens: int = 6144
    tool_tokens: int = 64
    stagger_s: float = 0.5
    serial_check: bool = True
    # Passes over every strategy, servers started afresh each time (makespans are medians).
    repeats: int = 1
    model: str | None = None
    # Every server's context (None: the model's, bounded by the KV cache).
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not self.agents or min(self.agents) < 2:
            raise InvalidRequestError("--agents takes counts of at least 2, like 4,8,16")
        if self.engine not in ENGINES:
            raise InvalidRequestError(f"--engine must be one of {', '.join(ENGINES)}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or "vllm" not in self.strategies:
            raise InvalidRequestError(
                f"--strategies must include vllm (the reference for identical messages) and "
                f"name only {', '.join(STRATEGIES)}; got {', '.join(self.strategies)}"
            )
        if self.repeats < 1:
            raise InvalidRequestError(f"--repeats takes a count of at least 1, got {self.repeats}")
        if self.slo_ttft_s <= 0 or self.max_tokens < 1:
            raise InvalidRequestError("--slo-ttft must be above 0 and --max-tokens at least 1")
        for ratio in (self.per_request_ratio, self.agent_ratio):
            if not 0 <= ratio <= 1:
                raise InvalidRequestError(f"recompute ratios are shares in [0, 1], got {ratio}")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"--dtype must be one of {', '.join(DTYPES)}")
        parse_size(self.kv_cache, "--kv-cache")
        parse_size(self.store_capacity, "--store-capacity")
        for n in self.agents:
            self.chats(n)  # the workload's own checks (tasks: a name per agent)

    @property
    def computed_in(self) -> str:
        """The dtype the servers compute in: `dtype` on vLLM, float32 on the reference engine."""
        return self.dtype if self.engine == "vllm" else "float32"

    def chats(self, agents: int) -> AgentsConfig:
        return AgentsConfig(
            self.workload,
            agents,
            self.rounds,
            self.seed,
            self.order,
            self.context_tokens,
            self.tool_tokens,
            self.stagger_s,
        )
