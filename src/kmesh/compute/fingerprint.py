"""SHA-256 fingerprints of model and adapter files: the `model` and `adapter` parts of keys."""

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
