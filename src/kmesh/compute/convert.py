"""A GGUF model made into a float32 safetensors model folder, once.

transformers dequantizes the GGUF; the folder is written beside its final place and renamed into
it, so a concurrent converter's result wins intact and an interrupted one leaves no half folder.
"""

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def convert_gguf(
    target: Path,
    description: str,
    gguf: Callable[[Path], Path],
    architecture: str,
    config: Mapping[str, Any] | None = None,
    add_bos_token: bool = False,
    chat_template: str | None = None,
) -> Path:
    """Make the model folder `target` from the GGUF file that `gguf(scratch)` returns (it may
    write the file into the empty folder `scratch`, removed afterwards). `architecture` is the
    class vLLM loads; `config` sets fields of the saved config.json; `add_bos_token` makes the
    saved tokenizer start every encoded text with BOS; `chat_template` gives a tokenizer without
    one a template. `description` names the model and its
    GGUF in the progress line on stderr."""
    print(f"kmesh: converting {description} to {target} (once; about a minute)...", file=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        source = gguf(scratch)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        # add_bos_token=True rebuilds tokenizer.json's post-processor to put BOS first.
        bos: dict[str, Any] = {"add_bos_token": True} if add_bos_token else {}
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, **bos)
        # NOTE: the weights are already dequantized, but save_pretrained refuses a model that
        # still names a GGUF quantizer; and the GGUF leaves `architectures` empty, which vLLM
        # needs to pick the model class.
        model.hf_quantizer = None  # type: ignore[assignment]
        del model.config.quantization_config
        model.config.architectures = [architecture]
        for key, value in (config or {}).items():
            setattr(model.config, key, value)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if add_bos_token:
            _declare_bos(staging, tokenizer.bos_token_id)
        try:
            staging.rename(target)  # atomic: a concurrent converter's result wins intact
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _declare_bos(folder: Path, bos_token_id: int) -> None:
    """Write `add_bos_token: true` into the saved tokenizer_config.json and check that the saved
    tokenizer adds BOS. NOTE: transformers 5 keeps BOS in tokenizer.json's post-processor and
    leaves the flag out when it saves; older readers of the folder look for the flag."""
    from transformers import AutoTokenizer

    config_file = folder / "tokenizer_config.json"
    declared = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**declared, "add_bos_token": True}, indent=2) + "\n")
    first = AutoTokenizer.from_pretrained(folder)("a").input_ids[0]
    if first != bos_token_id:
        raise RuntimeError(f"the converted tokenizer in {folder} does not add BOS ({first})")
