"""Adapters of the embedded model, made on first use and cached.

Adapter folders live in cache_dir()/adapters/<kind>-<name>-<recipe_digest>/ (cache_dir() is
$KMESH_CACHE_DIR or ~/.cache/kmesh) and hold peft's adapter_config.json and
adapter_model.safetensors (load with `PeftModel.from_pretrained(base, folder)`) plus kmesh.json:
kind, name, persona (its system prompt), invocation_text and invocation_tokens (activated only),
seed, steps, final_loss, train_seconds, recipe_digest. The digest covers the recipe and the base
model's fingerprint, so a folder never holds weights of another recipe or model; a folder is
complete once it exists (it is trained in a temporary sibling and renamed into place).
"""

import fcntl
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kmesh.adapters.recipes import AdapterRecipe, recipe_digest, recipes
from kmesh.adapters.train import BaseModel, TrainResult, load_base_model, train_adapter
from kmesh.compute.embedded import cache_dir, ensure_embedded_model
from kmesh.compute.fingerprint import fingerprint_files

MANIFEST = "kmesh.json"
# Held (flock) by the process training adapters, in adapters_root().
LOCK = ".training.lock"


def adapters_root() -> Path:
    return cache_dir() / "adapters"


def model_fingerprint(model_dir: Path) -> str:
    """The base model folder's fingerprint (config.json and weights), hashed once per process
    for a given set of file sizes and modification times."""
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    stamps = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _fingerprint(stamps)


@functools.lru_cache(maxsize=8)
def _fingerprint(stamps: tuple[tuple[str, int, int], ...]) -> str:
    return fingerprint_files([Path(name) for name, _, _ in stamps])


def adapter_dir(adapter: AdapterRecipe) -> Path:
    """Where `adapter`'s folder is (it may not exist yet)."""
    return _folder(adapter, recipe_digest(adapter, model_fingerprint(ensure_embedded_model())))


def _folder(adapter: AdapterRecipe, digest: str) -> Path:
    return adapters_root() / f"{adapter.kind}-{adapter.name}-{digest}"


def manifest(adapter: AdapterRecipe, result: TrainResult, digest: str) -> dict[str, Any]:
    data: dict[str, Any] = {
        "kind": adapter.kind,
        "name": adapter.name,
        "persona": adapter.persona.system_prompt,
    }
    if adapter.invocation_text is not None:
        data["invocation_text"] = adapter.invocation_text
        data["invocation_tokens"] = result.invocation_tokens
    data.update(
        seed=adapter.seed,
        steps=result.steps,
        final_loss=result.final_loss,
        train_seconds=round(result.train_seconds, 3),
        recipe_digest=digest,
    )
    return data


def build_adapter(adapter: AdapterRecipe, base: BaseModel, digest: str) -> Path:
    """Train `adapter` into a temporary sibling of its folder, then rename it into place."""
    target = _folder(adapter, digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".training-", dir=target.parent))
    try:
        result = train_adapter(adapter, base, staging)
        (staging / "README.md").unlink(missing_ok=True)  # peft's empty model card template
        text = json.dumps(manifest(adapter, result, digest), indent=2) + "\n"
        (staging / MANIFEST).write_text(text)
        try:
            staging.rename(target)  # atomic: a concurrent trainer's result wins intact
        except OSError:
            if not (target / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"kmesh: adapter {target.name}: {result.steps} steps, final loss "
        f"{result.final_loss:.3f}, {result.train_seconds:.1f} s",
        file=sys.stderr,
    )
    return target


def ensure_adapters(kind: str, count: int) -> list[Path]:
    """The folders of the first `count` adapters of `kind`, in recipe order; the missing ones
    are trained first (the base model is loaded once for all of them)."""
    wanted = recipes(kind, count)
    model_dir = ensure_embedded_model()
    fingerprint = model_fingerprint(model_dir)
    digests = [recipe_digest(adapter, fingerprint) for adapter in wanted]
    folders = [_folder(adapter, digest) for adapter, digest in zip(wanted, digests, strict=True)]
    if all((folder / MANIFEST).is_file() for folder in folders):
        return folders
    root = adapters_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / LOCK).open("a") as lock:
        # One trainer at a time: a process that finds another training waits for its folders
        # instead of training the same recipes again.
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [
            (adapter, digest)
            for adapter, digest, folder in zip(wanted, digests, folders, strict=True)
            if not (folder / MANIFEST).is_file()
        ]
        if missing:
            print(
                f"kmesh: training {len(missing)} {kind} adapter(s) of the embedded model into "
                f"{root} (once; about 15 s each)...",
                file=sys.stderr,
            )
            base = load_base_model(model_dir)
            for adapter, digest in missing:
                build_adapter(adapter, base, digest)
    return folders
