"""The connector's scheduler half: keys, the store protocol, families and per-request stats.

For each waiting request, vLLM reports its local prefix-cache hit (whole blocks); the blocks after
it are looked up in the store by chained SHA-256 block keys over (model fingerprint, LoRA adapter
name and path, cache_salt, parent key, block tokens):
- published blocks are claimed as a hit and loaded by the worker half before the forward pass
  (vLLM computes at least the prompt's last token, so at most the full blocks before it load);
- if another engine is computing the next block, the request waits ("ask again later": vLLM keeps
  it queued and asks each step), so across engines a shared trunk is computed once;
- the blocks no one has, this engine claims: once vLLM has computed one, the scheduler reserves a
  segment, the worker copies the block into it, and the scheduler commits it with its checksum.
Every store failure falls back to vLLM computing the tokens itself.

A request asking for recovery (`"recovery": {...}`, see kmesh.state.request_meta.RecoverySpec)
skips the store: its rows after the local hit, all but the prompt's last (a claim need not end on
a block boundary; policy full claims whole blocks only), are claimed and filled by the worker half
(kmesh/recovery/requests.py), which reports what it computed; blocks it could not fill (the quality
gate, no model attached) come back as load errors and vLLM computes them. Recovery is refused
(vLLM computes the prompt as usual) for LoRA requests, and an approximate one without a cache_salt
starting with APPROX_SALT_PREFIX, so approximate KV never enters another request's prefix hits.

A request under an activated adapter named with its start (kmesh/vllm/activated.py) has its rows
before that start claimed and filled with base-model KV: its whole blocks there are keyed as the
base model's, loaded from the store where published (from any base or activated request), the
rest computed by the worker half's executor on vLLM's base layers and published under those base
keys. While another request of this engine fills a base block it needs, it waits a step.

Families (see kmesh.state.request_meta): the trunk's blocks (the leading shared segments, or the
whole prompt without segments) are pinned in the store for the family while it is open here. A
family is open until it is closed, its declared branches have all finished, or it is the oldest of
more than MAX_OPEN_FAMILIES open ones (abandoned families are let go oldest first).
"""

import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kmesh.compute.fingerprint import fingerprint_files
from kmesh.errors import KMeshError
from kmesh.recovery.jobs import RecoveryJob, RecoveryReport
from kmesh.state.keys import BlockHash, KeyNamespace, extend_adapter_block_keys
from kmesh.state.request_meta import (
    KMESH_PARAMS_KEY,
    KMeshParams,
    RecoverySpec,
    parse_kmesh_params,
    recovery_refusal,
    segment_spans,
)
from kmesh.state.retention import Retention
from kmesh.state.segments import Span, trunk_end
from kmesh.store import (
    Hit,
    StoreClient,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    TenantClients,
)
from kmesh.store.client import encode_meta
from kmesh.vllm.activated import Activation, activation_of
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import (
    KeepOutput,
    KMeshConnectorMetadata,
    LoadBlock,
    SaveBlock,
    TenantKey,
)

log = logging.getLogger(__name__)

# While nothing of this engine runs, a request whose blocks another engine computes waits in the
# store this long per scheduler step instead of spinning.
IDLE_WAIT_S = 0.2
# A request stops waiting for another engine after this long and computes the blocks itself.
MAX_WAIT_S = 60.0
# An activated request's rows before its start: base-model KV, computed in full.
BASE_FILL = RecoverySpec(policy="full")
# Families held open here at most; past it the oldest is closed (its store pins let go).
MAX_OPEN_FAMILIES = 10_000


@dataclass(slots=True)
class _Tracked:
    """What the scheduler side knows of one request."""

    tenant: str | None
    params: KMeshParams | None
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
    lead: dict[int, bytes] = field(default_factory=dict)  # block index -> key this request leads
    waiting_since: float | None = None
    load_pinned: bool = False  # store hits pinned for it (see _load_pin)
    running: bool = False
    activation: Activation | None = None  # under an activated adapter (kmesh/vllm/activated.py)
    filling_base: bool = False  # its rows before the activation start are claimed


class SchedulerSide:
    def __init__(self, store: str | None, layout: BlockLayout, model: str) -> None:
        self.store = store
        self.layout = layout
        self.block_size = layout.block_size
        self.meta_bytes = encode_meta(layout.meta)
        self.model = model
        self.fingerprint = model_fingerprint(model)
        self._tokenizer: Any = None
        self._client = TenantClients(
            store or ""
        )  # without a store never used (it would be unavailable)
        self._requests: dict[str, _Tracked] = {}
        self._owner: dict[TenantKey, str] = {}  # keys this engine leads -> the leading request
        # Reserved, waiting for the worker's copy -> the family to pin the entry for, if any.
        self._reserved: dict[TenantKey, str | None] = {}
        self._loads: list[LoadBlock] = []
        self._recoveries: list[RecoveryJob] = []
        self._outputs: list[KeepOutput] = []
        # Stats of requests finished this step whose recovery report has not come yet.
        self._finishing: dict[str, dict[str, Any]] = {}
        # Finished requests the metrics have not taken yet: their stats (a recovery report
        # still to come this step lands in the same dict first) and generated tokens.
        self._finished: list[tuple[dict[str, Any], int]] = []
        self._block_ids: Any = None  # KVCacheManager.get_block_ids, bound by the connector
        self._families: dict[str, int] = defaultdict(int)  # finished requests per open family
        self._open_families: Retention[str] = Retention(MAX_OPEN_FAMILIES)
        self._family_tenants: dict[str, set[str | None]] = defaultdict(set)
        self.available = store is not None

    # -- vLLM's scheduler calls, forwarded by the connector ----------------------------------

    def bind_block_ids(self, get_block_ids: Any) -> None:
        """vLLM's KVCacheManager.get_block_ids: a request's block ids, per KV cache group."""
        self._block_ids = get_block_ids

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        tracked.local_tokens = num_computed_tokens
        tracked.hits = []
        first = num_computed_tokens // self.block_size
        loadable = (request.num_prompt_tokens - 1) // self.block_size
        if tracked.params is not None and tracked.params.recovery is not None:
            lora = request.lora_request
            refusal = recovery_refusal(
                tracked.params.recovery,
                request.cache_salt,
                None if lora is None else lora.lora_name,
            )
            if refusal is None:
                tracked.recovering = True
                claim = self._recovery_claim(request, tracked.params.recovery, first)
                return claim, False
            tracked.recovery = {"refused": refusal}  # served as an ordinary (exact) request
        activation = tracked.activation
        start = None if activation is None else activation.start
        if start is not None and num_computed_tokens < start:
            return self._base_claim(request, tracked, start, first), False
        if not self.available:
            return 0, False
        keys = [bytes(k) for k in tracked.keys[first:]]
        if first >= loadable or not keys:
            return 0, False
        # Hits stay pinned while the request lives, so none is evicted before the worker loads it.
        load_pin = _load_pin(request.request_id)
        try:
            client = self._client(tracked.tenant)
            got = client.acquire(keys, family=load_pin)
            tracked.load_pinned = tracked.load_pinned or bool(got.hits)
            waits = got.waiting_on is not None and first + len(got.hits) < loadable
            if waits and self._may_wait(tracked):
                if not any(t.running for t in self._requests.values()):
                    got = client.wait(keys, timeout=IDLE_WAIT_S, family=load_pin)
                    tracked.load_pinned = tracked.load_pinned or bool(got.hits)
                if got.waiting_on is not None and first + len(got.hits) < loadable:
                    return None, False
            self._pin_trunk(client, tracked)
        except StoreError as error:
            self._failed(error)
            return 0, False
        request_id = request.request_id
        for offset, key in enumerate(got.lead, start=first + len(got.hits)):
            owner = self._owner.setdefault((tracked.tenant, key), request_id)
            if owner == request_id:
                tracked.lead[offset] = key
        tracked.hits = list(got.hits[: max(0, loadable - first)])
        return len(tracked.hits) * self.block_size, False

    def _base_claim(self, request: Any, tracked: _Tracked, start: int, first: int) -> int | None:
        """Claim an activated request's rows after the local hit (`first` whole blocks) up to
        its activation start: the published base blocks load, the rest the worker computes.
        None (ask again next step) while another request of this engine fills the first base
        block it lacks."""
        tracked.filling_base, tracked.hits = True, []
        base_blocks = start // self.block_size
        if not self.available or first >= base_blocks:
            return start - tracked.local_tokens
        keys = [bytes(k) for k in tracked.keys[first:base_blocks]]
        try:
            client = self._client(tracked.tenant)
            got = client.acquire(keys, family=_load_pin(request.request_id))
            tracked.load_pinned = tracked.load_pinned or bool(got.hits)
            self._pin_trunk(client, tracked)
        except StoreError as error:
            self._failed(error)
            return start - tracked.local_tokens
        request_id, missing = request.request_id, first + len(got.hits)
        if missing < base_blocks:
            owner = self._owner.get((tracked.tenant, keys[len(got.hits)]), request_id)
            if owner != request_id and self._may_wait(tracked):
                return None
            for offset, key in enumerate(got.lead, start=missing):
                if self._owner.setdefault((tracked.tenant, key), request_id) == request_id:
                    tracked.lead[offset] = key
        tracked.hits = list(got.hits)
        return start - tracked.local_tokens

    @staticmethod
    def _may_wait(tracked: _Tracked) -> bool:
        """Whether the request may still wait for another to compute its blocks."""
        if tracked.waiting_since is None:
            tracked.waiting_since = time.monotonic()
        return time.monotonic() - tracked.waiting_since < MAX_WAIT_S

    def _recovery_claim(self, request: Any, spec: RecoverySpec, first: int) -> int:
        """Rows to claim after the local hit (`first` whole blocks): every one but the last
        (whose logits vLLM computes); for policy full whole blocks only, so that vLLM's own
        kernels compute the partial last one: full promises vLLM's computation up to rounding,
        and in bfloat16 KMesh's executor computing those last rows too moved a logprob by 0.125
        nats (tests/vllm/test_bf16.py)."""
        start = first * self.block_size
        if spec.approximate:
            return max(0, request.num_prompt_tokens - 1 - start)
        return max(0, (request.num_prompt_tokens - 1) // self.block_size * self.block_size - start)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._requests[request.request_id]
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        params = tracked.params
        if tracked.filling_base:
            self._fill_base(request, tracked, block_ids, num_external_tokens)
            return
        if tracked.recovering and params is not None and params.recovery is not None:
            start = tracked.local_tokens
            end = start + num_external_tokens
            self._recover(request, tracked, block_ids, (start, end), params.recovery, params.family)
            return
        self._load_hits(tracked, block_ids, num_external_tokens // self.block_size)

    def _load_hits(self, tracked: _Tracked, block_ids: list[int], count: int) -> None:
        """Queue the first `count` store hits for the worker to load after the local hit."""
        first = tracked.local_tokens // self.block_size
        for i, hit in enumerate(tracked.hits[:count]):
            self._loads.append(LoadBlock(tracked.tenant, block_ids[first + i], hit))
            tracked.loaded_block_ids.add(block_ids[first + i])
        tracked.loaded_tokens = min(count, len(tracked.hits)) * self.block_size

    def _fill_base(
        self, request: Any, tracked: _Tracked, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """An activated request's claim: its store hits load, the executor computes the rest
        (a full recovery job: exact base-model KV)."""
        self._load_hits(tracked, block_ids, num_external_tokens // self.block_size)
        start = tracked.local_tokens + tracked.loaded_tokens
        end = tracked.local_tokens + num_external_tokens
        if start < end:
            self._recover(request, tracked, block_ids, (start, end), BASE_FILL, None)

    def _recover(
        self,
        request: Any,
        tracked: _Tracked,
        block_ids: list[int],
        rows: tuple[int, int],
        spec: RecoverySpec,
        family: str | None,
    ) -> None:
        """Queue a recovery job filling the request's rows [start, end) for the worker."""
        start, end = rows
        spans = [] if spec is BASE_FILL else tracked.spans
        job = RecoveryJob(
            request.request_id,
            list(request.prompt_token_ids),
            list(block_ids),
            start,
            end,
            tracked.tenant,
            spans,
            spec,
            family,
        )
        self._recoveries.append(job)
        tracked.recovered_tokens = end - start
        bs = self.block_size
        tracked.recovered_block_ids = set(block_ids[start // bs : -(-end // bs)])

    def build_connector_meta(self, scheduler_output: Any) -> KMeshConnectorMetadata:
        meta = KMeshConnectorMetadata(
            loads=self._loads, recoveries=self._recoveries, outputs=self._outputs
        )
        self._loads, self._recoveries, self._outputs = [], [], []
        scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for request_id, num_computed in scheduled:
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            tracked.running = True
            done = num_computed + scheduler_output.num_scheduled_tokens[request_id]
            ready = [i for i in tracked.lead if (i + 1) * self.block_size <= done]
            if ready and self.available:
                meta.saves += self._reserve(request_id, tracked, ready)
        return meta

    def update_connector_output(self, saved: dict[TenantKey, int | None]) -> None:
        for (tenant, key), crc in saved.items():
            self._owner.pop((tenant, key), None)
            family = self._reserved.pop((tenant, key), None)
            if not self.available:
                continue
            try:
                client = self._client(tenant)
                if crc is None:
                    client.abandon([key])
                else:
                    client.commit(key, crc, self.meta_bytes, family)
            except StoreRefused as refused:
                log.info("kmesh store: block not published: %s", refused)
            except StoreError as error:
                self._failed(error)

    def recovery_reports(self, reports: dict[str, RecoveryReport]) -> None:
        """The worker's reports of this step. vLLM hands them over after it finished this
        step's requests (vllm/v1/core/sched/scheduler.py::update_from_output calls
        request_finished before update_connector_output), so a request that finished in the same
        step gets its report in the stats dict it already returned, before vLLM sends it out."""
        for request_id, report in reports.items():
            tracked = self._requests.get(request_id)
            if tracked is not None:
                tracked.recovery = asdict(report)
            elif request_id in self._finishing:
                self._finishing[request_id]["recovery"] = asdict(report)
        self._finishing.clear()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any]]:
        """Release what the request led and did not publish; whether its blocks stay allocated
        for the worker to keep its output's KV (`keep_output`), and its stats for the caller."""
        tracked = self._requests.pop(request.request_id, None)
        if tracked is None:
            return False, {}
        keep = self._keep_output(request, tracked, block_ids)
        unpublished = [
            key
            for key in tracked.lead.values()
            if (tracked.tenant, key) not in self._reserved
            and self._owner.get((tracked.tenant, key)) == request.request_id
        ]
        for key in unpublished:
            del self._owner[(tracked.tenant, key)]
        if self.available and (unpublished or tracked.load_pinned):
            try:
                client = self._client(tracked.tenant)
                if unpublished:
                    client.abandon(unpublished)
                if tracked.load_pinned:
                    client.close_family(_load_pin(request.request_id))
            except StoreError as error:
                self._failed(error)
        self._end_family_member(tracked)
        prompt = request.num_prompt_tokens
        stats: dict[str, Any] = {
            "prompt_tokens": prompt,
            "reused_tokens": tracked.local_tokens,
            "restored_tokens": tracked.loaded_tokens,
            "recovered_tokens": tracked.recovered_tokens,
            "computed_tokens": prompt
            - tracked.local_tokens
            - tracked.loaded_tokens
            - tracked.recovered_tokens,
            "family": None if tracked.params is None else tracked.params.family,
        }
        if tracked.activation is not None:
            stats["activation"] = {
                k: v for k, v in asdict(tracked.activation).items() if v is not None or k == "start"
            }
        if tracked.recovery is not None:
            stats["recovery"] = tracked.recovery
        elif tracked.recovered_tokens:
            self._finishing[request.request_id] = stats  # its report comes in this same step
        if keep:
            stats["kept_output_tokens"] = len(self._outputs[-1].token_ids)
        self._finished.append((stats, len(request.output_token_ids)))
        return keep, stats

    def take_finished(self) -> list[dict[str, Any]]:
        """Stats of the requests finished since the last call, each with completion_tokens (for
        vLLM's metrics: kmesh/vllm/metrics.py)."""
        finished = [{**stats, "completion_tokens": n} for stats, n in self._finished]
        self._finished = []
        return finished

    def _keep_output(self, request: Any, tracked: _Tracked, block_ids: list[int]) -> bool:
        """Queue the request's generated rows for the worker to keep, if it asked; their KV is
        the base model's (a LoRA request's is not kept)."""
        params = tracked.params
        if params is None or not params.keep_output:
            return False
        if request.lora_request is not None:
            log.info(
                "kmesh: request %s: keep_output under a LoRA adapter is ignored", request.request_id
            )
            return False
        start = request.num_prompt_tokens
        fed = min(request.num_computed_tokens, start + len(request.output_token_ids)) - start
        if fed <= 0:
            return False
        self._outputs.append(
            KeepOutput(
                request.request_id,
                tracked.tenant,
                list(request.output_token_ids[:fed]),
                list(block_ids),
                start,
            )
        )
        return True

    def load_failed(self, block_ids: set[int]) -> None:
        """The worker could not load these blocks; vLLM recomputes them: not restored."""
        for tracked in self._requests.values():
            lost = len(tracked.loaded_block_ids & block_ids)
            tracked.loaded_block_ids -= block_ids
            tracked.loaded_tokens -= lost * self.block_size
            given_back = bool(tracked.recovered_block_ids & block_ids)
            if given_back:  # given back whole: vLLM computes all
                tracked.recovered_block_ids = set()
                tracked.recovered_tokens = 0
            if tracked.filling_base and tracked.activation is not None and (lost or given_back):
                tracked.activation = replace(
                    tracked.activation,
                    note="its base-model rows could not all be filled (see the log): vLLM "
                    "computed some of them under the adapter",
                )

    def close(self) -> None:
        self._client.close()

    # -- internals -------------------------------------------------------------------------

    def _track(self, request: Any) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            return tracked
        params = _request_params(request)
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
        tracked = _Tracked(request.cache_salt, params, keys, trunk, spans, activation=activation)
        self._requests[request.request_id] = tracked
        return tracked

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

    def _tokenizer_of_model(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self._tokenizer

    def _pin_trunk(self, client: StoreClient, tracked: _Tracked) -> None:
        if tracked.trunk_blocks and tracked.params is not None and tracked.params.family:
            family = tracked.params.family
            self._family_tenants[family].add(tracked.tenant)
            client.pin(family, [bytes(k) for k in tracked.keys[: tracked.trunk_blocks]])

    def _reserve(self, request_id: str, tracked: _Tracked, ready: list[int]) -> list[SaveBlock]:
        block_ids = self._block_ids(request_id)[0]
        saves: list[SaveBlock] = []
        for index in ready:
            key = tracked.lead.pop(index)
            try:
                segment = self._client(tracked.tenant).reserve(key, self.layout.block_bytes)
            except StoreRefused as refused:
                log.info("kmesh store: keeping block %d local: %s", index, refused)
                self._owner.pop((tracked.tenant, key), None)
                continue
            except StoreError as error:
                self._failed(error)
                return saves
            params, in_trunk = tracked.params, index < tracked.trunk_blocks
            family = params.family if params is not None and in_trunk else None
            self._reserved[(tracked.tenant, key)] = family
            saves.append(SaveBlock(tracked.tenant, block_ids[index], key, segment))
        return saves

    def _end_family_member(self, tracked: _Tracked) -> None:
        params = tracked.params
        if params is None or params.family is None:
            return
        family = params.family
        self._families[family] += 1
        if params.close or (
            params.branches is not None and self._families[family] >= params.branches
        ):
            ended = [family]
        else:
            ended = self._open_families.add(family)  # the oldest open ones, past the limit
        for done in ended:
            del self._families[done]
            self._open_families.discard(done)
            for tenant in self._family_tenants.pop(done, set()):
                if self.available:
                    try:
                        self._client(tenant).close_family(done)
                    except StoreError as error:
                        self._failed(error)

    def _failed(self, error: StoreError) -> None:
        if isinstance(error, StoreUnavailable):
            log.warning("kmesh store: unavailable, vLLM computes without it from now on: %s", error)
            self.available = False
            self._owner.clear()
            self._reserved.clear()
            self.close()
        else:
            log.info("kmesh store: %s; computing instead", error)


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


def _load_pin(request_id: str) -> str:
    """The store family that pins a request's hits until it finishes."""
    return f"kmesh-load:{request_id}"


def model_fingerprint(model: str) -> str:
    """The `model` part of state keys: the SHA-256 of the folder's config and weights (as the
    reference engine computes it), or the model's name when it is not a local folder."""
    path = Path(model)
    weights = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if (path / "config.json").is_file() and weights:
        return fingerprint_files([path / "config.json", *weights])
    return f"name:{model}"
