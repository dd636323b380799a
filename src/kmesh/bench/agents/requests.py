"""The request body each strategy of `kmesh bench agents` sends for one agent call.

Every body is what a framework sends: model, messages, max_tokens, temperature 0, a stream with
usage, and one cache_salt per run (RunNames: runs never share state). KMesh strategies add the
`kmesh` object for the agents' calls (plain one-off chats get none):
- kmesh_exact: `messages` (each message's id and role), and a family (the All-Gather council,
  or one per trajectory agent) that closes after its last call (`branches`); no recovery, an
  exact salt.
- kmesh_per_request: the same, with per-request recovery at `per_request_ratio` and
  `keep_output` (a message's KV as its author generated it), under a kmesh-approx salt; a call
  with a round after it declares its transcript's `next_use` (that round's index), as a
  framework that knows its agents come back would.
- kmesh_collective: the same, with each All-Gather round from round 1 on declared
  (`recovery.round`: the previous round's outputs, mirrored from one master) at `agent_ratio`;
  trajectory agents, which read no round, get per-request recovery at that ratio; `next_use`
  as kmesh_per_request's.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kmesh.state.recovery_meta import APPROX_SALT_PREFIX
from kmesh.workloads.agent_chats import AgentCall

if TYPE_CHECKING:
    from kmesh.bench.agents.config import AgentsBenchConfig


@dataclass(frozen=True, slots=True)
class RunNames:
    """The salt and families of one strategy's run at one agent count."""

    strategy: str
    run: str  # unique per run, like "allgather-16-0-1a2b3c4d"
    agents: int
    rounds: int

    @property
    def salt(self) -> str:
        if self.strategy in ("kmesh_per_request", "kmesh_collective"):
            return f"{APPROX_SALT_PREFIX}:{self.strategy}:{self.run}"
        return f"{self.strategy}:{self.run}"

    def family(self, call: AgentCall) -> tuple[str, int]:
        """(family id, its calls) of an agent's call: the council's, or the trajectory's."""
        if call.kind == "allgather":
            return f"council:{self.run}", self.agents * self.rounds
        return f"{call.agent}:{self.run}", self.rounds


def request_body(
    strategy: str,
    call: AgentCall,
    round_index: int,
    names: RunNames,
    cfg: "AgentsBenchConfig",
    model_id: str,
) -> dict[str, Any]:
    """The chat body of `call` (round `round_index`) under `strategy` (module docstring)."""
    body: dict[str, Any] = {
        "model": model_id,
        "messages": [{"role": m.role, "content": m.content} for m in call.messages],
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": names.salt,
    }
    if strategy == "vllm" or call.kind == "plain":
        return body
    family, calls = names.family(call)
    kmesh: dict[str, Any] = {
        "family": family,
        "branches": calls,
        "messages": [
            {"id": m.id, "role": "shared" if m.shared else "private"} for m in call.messages
        ],
    }
    if strategy == "kmesh_per_request":
        kmesh["recovery"] = {"policy": "kv_deviation", "ratio": cfg.per_request_ratio}
        kmesh["keep_output"] = True
    elif strategy == "kmesh_collective":
        recovery: dict[str, Any] = {"policy": "kv_deviation", "ratio": cfg.agent_ratio}
        if call.round_outputs:
            recovery["round"] = {"id": f"r{round_index}", "segments": list(call.round_outputs)}
        kmesh["recovery"] = recovery
    if "recovery" in kmesh and round_index + 1 < names.rounds:
        kmesh["next_use"] = round_index + 1
    body["kmesh"] = kmesh
    return body
