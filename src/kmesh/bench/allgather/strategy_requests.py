"""The All-Gather strategies as requests an engine takes: a cache salt and a `kmesh` object.

vLLM with KMeshConnector and the reference engine serve the same declarations (kmesh/recovery/
requests.py), so both request-level benches (the vLLM bench, the closed loop) send these:
- full: a salt of its own per prompt (no prefix hit): vanilla full prefill;
- prefix: no salt: vanilla prefix caching;
  (both turn off KMeshConnector's page tails, `page_tails: false`, to stay vanilla vLLM's);
- per_request: the prompt's segments and a recovery policy (stored segment KV reused per request),
  every turn keeping its output (`keep_output`): the next round's readers start from the outputs'
  author KV, as in the reference bench;
- collective: the segments, a family and the round (the previous round's outputs, in author
  order: the master's canonical order), `agent_ratio` recomputed per agent.
Approximate strategies run under salts starting with `kmesh-approx` (each its own). Round 0 holds
no outputs (collective declares no round in it), so recovery reuses only the first agent's trunk
past the engine's last whole page in the others, as it is (kmesh/recovery/prefix_tails.py), and
keeps each prompt's tail for its next round.
"""

from typing import Any

from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.state.segments import Segment
from kmesh.workloads.allgather import AgentTurn, output_segment_id

FAMILY = "allgather"
# The vanilla strategies' kmesh object: vLLM's own whole-page prefix caching, nothing more.
VANILLA = {"page_tails": False}


def strategy_request(
    name: str, r: int, turn: AgentTurn, cfg: AllGatherBenchConfig, agents: int, variant: str = ""
) -> tuple[str | None, dict[str, Any] | None]:
    """(cache salt, kmesh object or None) of one agent turn under strategy `name`; `variant`
    keeps a run's salts apart from another run's."""
    if name == "full":
        return f"full:{r}:{turn.agent}{variant}", dict(VANILLA)
    if name == "prefix":
        return None if not variant else f"prefix{variant}", dict(VANILLA)
    salt = f"kmesh-approx:{name}{variant}"
    keep = {"keep_output": True} if name == "per_request" else {}
    segments = [_segment_spec(s) for s in turn.prompt.segments]
    ratio = cfg.recompute_ratio if name == "per_request" else cfg.agent_ratio
    recovery: dict[str, Any] = {"gate_sample": cfg.gate_sample}
    if cfg.check_layer is not None:  # else the model's default
        recovery["check_layer"] = cfg.check_layer
    if cfg.quality is not None:  # the engine resolves it (kmesh/recovery/quality.py)
        recovery["quality"] = cfg.quality
    else:
        recovery |= {"policy": cfg.policy, "gate": cfg.gate, "ratio": ratio}
    # Its place in the next round: the store keeps its transcript by it.
    next_use = float((r + 1) * agents + turn.agent)
    if r == 0 and name == "collective":  # no round to declare yet
        return salt, {
            "family": FAMILY,
            "segments": segments,
            "recovery": recovery,
            "next_use": next_use,
        }
    if name == "per_request":
        return salt, {
            "segments": segments,
            "recovery": recovery,
            **keep,
        }
    round_ = {
        "id": f"r{r}",
        "segments": [output_segment_id(r - 1, a) for a in range(agents)],
        "master": cfg.master,
        "shared_ratio": cfg.shared_ratio,
    }
    return salt, {
        "family": FAMILY,
        "segments": segments,
        "recovery": {**recovery, "round": round_},
        "next_use": next_use,
    }


def _segment_spec(segment: Segment) -> dict[str, Any]:
    spec: dict[str, Any] = {"token_ids": list(segment.token_ids), "role": segment.role.value}
    if segment.segment_id is not None:
        spec["id"] = segment.segment_id
    return spec
