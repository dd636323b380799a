"""SHA-256 fingerprints of model and adapter files: the `model` and `adapter` parts of keys.

`model_fingerprint` is the one rule for a model: the reference engine (compute/loader.py) and the
vLLM connector's two halves key state by it, so they share hits for the same folder.
"""

import hashlib
from pathlib import Path


def fingerprint_files(paths: list[Path]) -> str:
    """Digest over each file's name and bytes, in the order given."""
    digest = hashlib.sha256(b"kmesh-model-fingerprint-v1")
    for path in paths:
        digest.update(path.name.encode() + b"\x00")
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(model: str | Path) -> str:
    """The `model` part of state keys: the digest of a model folder's config.json and weights
    (*.safetensors, sorted), or `name:<model>` when `model` is not such a folder."""
    path = Path(model)
    weights = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if (path / "config.json").is_file() and weights:
        return fingerprint_files([path / "config.json", *weights])
    return f"name:{model}"
