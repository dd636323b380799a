"""Traces: a workload's turns as JSON lines, replayed exactly by the benches.

The first line holds the workload kind (`allgather`: workloads/allgather.py, `trajectory`:
workloads/trajectory.py), its config and the model fingerprint; then one line per agent turn (its
prompt's segments, its output). A trace is deterministic in (model, config).
"""

import json
from dataclasses import asdict
from pathlib import Path

from kmesh.errors import InvalidRequestError
from kmesh.state.segments import Role, Segment, SegmentedPrompt
from kmesh.workloads.allgather import AgentTurn, AllGatherConfig
from kmesh.workloads.trajectory import TrajectoryConfig

WorkloadConfig = AllGatherConfig | TrajectoryConfig
KINDS: dict[str, type[AllGatherConfig] | type[TrajectoryConfig]] = {
    "allgather": AllGatherConfig,
    "trajectory": TrajectoryConfig,
}


def save_trace(path: Path, cfg: WorkloadConfig, model: str, turns: list[AgentTurn]) -> None:
    """One JSON line for the kind, config and model fingerprint, then one per agent turn."""
    kind = next(k for k, c in KINDS.items() if isinstance(cfg, c))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        out.write(json.dumps({"kind": kind, "config": asdict(cfg), "model": model}) + "\n")
        for turn in turns:
            segments = [
                {
                    "token_ids": list(s.token_ids),
                    "role": s.role.value,
                    "id": s.segment_id,
                    "text": s.text,
                    "message_role": s.message_role,
                }
                for s in turn.prompt.segments
            ]
            line = {
                "round": turn.round,
                "agent": turn.agent,
                "segments": segments,
                "output_ids": list(turn.output_ids),
                "output_text": turn.output_text,
            }
            out.write(json.dumps(line) + "\n")


def load_trace(path: Path) -> tuple[WorkloadConfig, str, list[AgentTurn]]:
    """Read a trace written by save_trace: (config, model fingerprint, turns)."""
    if not path.is_file():
        raise InvalidRequestError(f"trace {str(path)!r} does not exist")
    lines = path.read_text().splitlines()
    try:
        head = json.loads(lines[0])
        if head.get("kind") not in KINDS:
            raise ValueError(f"the first line names no workload kind of {sorted(KINDS)}")
        cfg = KINDS[head["kind"]](**head["config"])
        turns = []
        for line in lines[1:]:
            item = json.loads(line)
            segments = [
                Segment(
                    tuple(s["token_ids"]), Role(s["role"]), s["id"], s["text"], s["message_role"]
                )
                for s in item["segments"]
            ]
            turns.append(
                AgentTurn(
                    item["round"],
                    item["agent"],
                    SegmentedPrompt.of(segments),
                    tuple(item["output_ids"]),
                    item["output_text"],
                )
            )
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise InvalidRequestError(
            f"trace {str(path)!r} is not a trace written by `kmesh workload allgather` or a "
            f"bench: {error}"
        ) from None
    return cfg, head["model"], turns
