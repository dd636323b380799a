"""The float32 embedded model's engines that several test modules read, in one process (one
vLLM import and warm-up for all): `python tests/vllm/embedded_job.py OUT_DIR`. Runs
connector_job.py's engines (KMeshConnector with a store and LoRA, then vanilla vLLM) and
transcript_job.py's (two instances on two stores in front of one remote tier), one after
another, each in OUT_DIR/<part>/, and writes OUT_DIR/result.json: {part: its result}. Read
through `shared_job` (tests/vllm/conftest.py) by test_connector.py and test_transcripts.py.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import connector_job
import transcript_job

PARTS = {"connector": connector_job.main, "transcript": transcript_job.main}


def main(out_dir: Path) -> None:
    result = {}
    for name, run in PARTS.items():
        (out_dir / name).mkdir()
        run(out_dir / name)
        result[name] = json.loads((out_dir / name / "result.json").read_text())
    (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
