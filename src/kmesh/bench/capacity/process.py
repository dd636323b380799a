"""`kmesh bench capacity`'s vLLM runs as child processes (bench/capacity/vllm.py: vLLM spawns
workers, so it needs a main guard): a spec in, its result or the first error its log names out."""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

VLLM_TIMEOUT_S = 3600
# The line naming what failed in a vLLM process's log: a worker's error, or an exception.
ROOT_CAUSE = re.compile(r"Worker failed with error '[^\n]*'|\b\w+Error: [^\n]*")


def run_vllm_process(spec: dict[str, Any], stem: Path) -> dict[str, Any]:
    """Run bench/capacity/vllm.py on `spec`; its result, or {"error": why}."""
    path, log_path, result_path = (stem.with_suffix(s) for s in (".spec", ".log", ".json"))
    path.write_text(json.dumps({**spec, "result": str(result_path)}))
    with log_path.open("w") as out:
        try:
            subprocess.run(
                [sys.executable, "-m", "kmesh.bench.capacity.vllm", str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=VLLM_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish in {VLLM_TIMEOUT_S} s"}
    cause = root_cause(log_path.read_text())
    if not result_path.is_file():
        return {"error": f"ended without a result: {cause or 'no error in its log'}"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    if "error" in result:
        return {"error": result["error"] if cause is None else f"{cause} ({result['error']})"}
    result["connector"] = spec["connector"]
    return result


def root_cause(log: str) -> str | None:
    """The first error vLLM's processes logged (what failed first), if any."""
    found = ROOT_CAUSE.search(log)
    return found.group(0) if found else None
