"""What the connector's scheduler half knows of one vLLM request: its kmesh params, its chained
block keys, its family trunk and segments, and what it restored, recovered and computed.

Keys are chained SHA-256 block keys over (model fingerprint, LoRA adapter name and path,
cache_salt, parent key, block tokens); under an activated adapter (kmesh/vllm/activated.py) the
blocks before its start are keyed as the base model's. The family trunk is the leading shared
segments, or the whole prompt without segments.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kmesh.errors import KMeshError
from kmesh.recovery.quality import resolve_quality
from kmesh.state.keys import BlockHash, KeyNamespace, extend_adapter_block_keys
from kmesh.state.request_meta import (
    KMESH_PARAMS_KEY,
    KMeshParams,
    parse_kmesh_params,
    segment_spans,
)
from kmesh.state.segments import Span, trunk_end
from kmesh.store import Hit
from kmesh.vllm.activated import Activation, activation_of
from kmesh.vllm.page_tails import TailHit

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    """What the scheduler side knows of one request."""

    tenant: str | None
    params: KMeshParams | None
    prompt_ids: Sequence[int]
    keys: list[BlockHash]  # chained keys of the prompt's full blocks
    trunk_blocks: int  # the family's pinned blocks: keys[:trunk_blocks]
    spans: list[Span]  # its segments' token ranges (empty without segments)
    local_tokens: int = 0  # vLLM's local prefix-cache hit
    hits: list[Hit] = field(default_factory=list)  # loadable store hits after the local hit
    loaded_tokens: int = 0
    loaded_block_ids: set[int] = field(default_factory=set)
    recovered_tokens: int = 0  # filled by recovery (kmesh.recovery) instead of vLLM
    recovering: bool = False  # its blocks after the local hit are claimed for recovery
    recovered_block_ids: set[int] = field(default_factory=set)
    recovery: dict[str, Any] | None = None  # the worker's report, or why recovery was refused
    quality: dict[str, Any] | None = None  # what served its quality target (recovery/quality.py)
    running: bool = False
    activation: Activation | None = None  # under an activated adapter (kmesh/vllm/activated.py)
    filling_base: bool = False  # its rows before the activation start are claimed
    takes_tails: bool = False  # files and takes kept page tails (tail_claims.py)
    tail: TailHit | None = None  # the kept tail its claim reaches
    tail_tokens: int = 0  # rows copied from a kept tail
    tail_block_id: int | None = None  # the block they were copied into


class RequestTracker:
    """Builds a `Tracked` for each new vLLM request (see the module docstring)."""

    def __init__(self, model: str, fingerprint: str, block_size: int) -> None:
        self.model = model
        self.fingerprint = fingerprint
        self.block_size = block_size
        self._tokenizer: Any = None

    def track(self, request: Any) -> Tracked:
        params = _request_params(request)
        quality = None
        if params is not None and params.recovery is not None:
            spec, quality = resolve_quality(params.recovery, self.fingerprint)
            params = params.model_copy(update={"recovery": spec})
        lora = request.lora_request
        prompt = list(request.prompt_token_ids or [])
        base = KeyNamespace(self.fingerprint, None, request.cache_salt)
        activation = None  # an activated adapter's name carries its start
        if lora is not None:
            activation = activation_of(lora.lora_name, lora.lora_path, prompt)
        start, adapted = len(prompt), base
        if lora is not None:
            start = 0 if activation is None or activation.start is None else activation.start
            adapted = replace(base, adapter=f"{lora.lora_name}@{lora.lora_path}")
        keys: list[BlockHash] = []
        extend_adapter_block_keys(keys, base, adapted, prompt, self.block_size, start)
        spans = [] if params is None else self._spans(request, params)
        trunk = self._trunk_blocks(params, spans, len(keys))
        plain = lora is None and (params is None or (params.recovery is None and params.page_tails))
        return Tracked(
            request.cache_salt,
            params,
            prompt,
            keys,
            trunk,
            spans,
            activation=activation,
            takes_tails=plain,
            quality=quality,
        )

    def _spans(self, request: Any, params: KMeshParams) -> list[Span]:
        """The segments' token ranges, if they spell the prompt; else none (all computed)."""
        if params.separator is not None:
            log.warning(
                "kmesh: request %s: a separated prompt reached vLLM as one text; kmesh serve "
                "splits it into segments (send segments to a plain vLLM server)",
                request.request_id,
            )
        if params.segments is None:
            return []
        ids, spans = segment_spans(self._tokenizer_of_model(), params)
        if ids != list(request.prompt_token_ids):
            log.warning(
                "kmesh: request %s: its segments do not spell its prompt; recovering it without "
                "them (every claimed token is computed)",
                request.request_id,
            )
            return []
        return spans

    def _trunk_blocks(self, params: KMeshParams | None, spans: list[Span], num_blocks: int) -> int:
        if params is None or params.family is None:
            return 0
        if params.segments is None:
            return num_blocks
        return min(num_blocks, trunk_end(spans) // self.block_size)

    def warm(self) -> None:
        """Load the model's tokenizer now. Loaded on the first request with segments instead, it
        held up the step vLLM schedules that request in, every request of it, by about 0.3 s.
        A model it cannot load from is left to fail there, as before (logged here)."""
        try:
            self._tokenizer_of_model()
        except Exception as error:  # raised again where segments need it
            log.info(
                "kmesh: no tokenizer for %s yet (%s): segments will need one", self.model, error
            )

    def _tokenizer_of_model(self) -> Any:
        if self._tokenizer is None:
            from kmesh.compute.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.model)
        return self._tokenizer


def _request_params(request: Any) -> KMeshParams | None:
    params = (request.kv_transfer_params or {}).get(KMESH_PARAMS_KEY)
    if params is None:
        return None
    try:
        return parse_kmesh_params(params)
    except KMeshError as error:
        log.warning(
            "kmesh: request %s: %s; serving it without kmesh metadata", request.request_id, error
        )
        return None
