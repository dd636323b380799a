"""The connector's scheduler half: what vLLM's scheduler asks a KV connector, answered from the
store (store_side.py), recovery claims (recovery_claims.py) and per-request tracking (tracked.py),
with each finished request's stats.

For each waiting request, vLLM reports its local prefix-cache hit (whole blocks); after it:
- a request asking for recovery has its rows claimed for the worker half to fill
  (recovery_claims.py), and skips the store's blocks (the worker half restores and publishes
  its transcript instead: kmesh/store/shared/transcripts.py); in an engine that cannot recover
  (recovery_support.py: no KMesh worker) it is refused up front, with the reason;
- an activated request's rows before its start are claimed: its base blocks load from the store
  where published, the rest the worker half computes; while another request of this engine fills
  a base block it needs, it waits a step;
- otherwise the published blocks load from the store (vLLM computes at least the prompt's last
  token, so at most the full blocks before it load), the request waits while another engine
  computes the next one, and the blocks no one has this engine computes and publishes
  (store_side.py); after them, the rows of a partly used page that an earlier request of this
  engine computed are copied from the tail the worker half keeps (tail_claims.py).
Every store failure falls back to vLLM computing the tokens itself.
"""

import logging
from dataclasses import asdict, replace
from typing import Any

from kmesh.compute.fingerprint import model_fingerprint
from kmesh.recovery.jobs import RecoveryJob, RecoveryReport
from kmesh.state.recovery_meta import recovery_refusal
from kmesh.store.policy import TenantKey
from kmesh.vllm.layout import BlockLayout
from kmesh.vllm.metadata import KeepOutput, KMeshConnectorMetadata, LoadBlock
from kmesh.vllm.recovery_claims import BASE_FILL, recovery_claim, recovery_job
from kmesh.vllm.store_side import StoreSide
from kmesh.vllm.tail_claims import TailClaims
from kmesh.vllm.tracked import RequestTracker, Tracked

log = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(
        self,
        store: str | None,
        layout: BlockLayout,
        model: str,
        recovery_unavailable: str | None = None,
        finished_tails: bool = True,
        prefault_blocks: int = 0,
    ) -> None:
        """`recovery_unavailable`: why this engine cannot recover (recovery_support.py), or
        None; every request asking for recovery is then refused with that reason.
        `finished_tails`: whether finished requests' page tails are kept (tail_claims.py).
        `prefault_blocks`: store segments of a block's size made ready now (StoreSide.prefault)."""
        self.layout = layout
        self.recovery_unavailable = recovery_unavailable
        if recovery_unavailable is not None:
            log.warning(
                "kmesh: recovery is unavailable: %s. Requests asking for it are computed by vLLM "
                "and their kv_transfer_params say why (kmesh.recovery.refused).",
                recovery_unavailable,
            )
        self.block_size = layout.block_size
        self.model = model
        self.fingerprint = model_fingerprint(model)
        self.store = StoreSide(store, layout)
        self.store.prefault(prefault_blocks)
        row_bytes = layout.block_bytes // self.block_size
        self.tails = TailClaims(self.fingerprint, self.block_size, row_bytes, finished_tails)
        self.meta_bytes = self.store.meta_bytes
        self._tracker = RequestTracker(model, self.fingerprint, self.block_size)
        self._requests: dict[str, Tracked] = {}
        self._loads: list[LoadBlock] = []
        self._recoveries: list[RecoveryJob] = []
        self._outputs: list[KeepOutput] = []
        # Stats of requests finished this step whose recovery report has not come yet.
        self._finishing: dict[str, dict[str, Any]] = {}
        # Finished requests the metrics have not taken yet: their stats (a recovery report
        # still to come this step lands in the same dict first) and generated tokens.
        self._finished: list[tuple[dict[str, Any], int]] = []
        self._block_ids: Any = None  # KVCacheManager.get_block_ids, bound by the connector

    def warm(self) -> None:
        """Load now what the first request would otherwise load inside vLLM's schedule call:
        the tokenizer its segments are spelt with (RequestTracker.warm)."""
        self._tracker.warm()

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
            refusal = self.recovery_unavailable or recovery_refusal(
                tracked.params.recovery,
                request.cache_salt,
                None if lora is None else lora.lora_name,
            )
            if refusal is None:
                tracked.recovering = True
                spec = tracked.params.recovery
                return recovery_claim(request, spec, first, self.block_size), False
            tracked.recovery = {"refused": refusal}  # served as an ordinary (exact) request
        activation = tracked.activation
        start = None if activation is None else activation.start
        if start is not None and num_computed_tokens < start:
            return self._base_claim(request, tracked, start, first), False
        if not self.store.available or first >= loadable or first >= len(tracked.keys):
            return self.tails.claim(request, tracked, num_computed_tokens), False
        idle = not any(t.running for t in self._requests.values())
        got = self.store.load(request.request_id, tracked, first, loadable, idle)
        if got is None:
            return None, False
        tracked.hits = list(got.hits[: max(0, loadable - first)])
        loaded = len(tracked.hits) * self.block_size
        return loaded + self.tails.claim(request, tracked, num_computed_tokens + loaded), False

    def _base_claim(self, request: Any, tracked: Tracked, start: int, first: int) -> int | None:
        """Claim an activated request's rows after the local hit (`first` whole blocks) up to
        its activation start: the published base blocks load, the rest the worker computes.
        None (ask again next step) while another request of this engine fills the first base
        block it lacks."""
        tracked.filling_base, tracked.hits = True, []
        base_blocks = start // self.block_size
        if not self.store.available or first >= base_blocks:
            return start - tracked.local_tokens
        got = self.store.load_base(request.request_id, tracked, first, base_blocks)
        if got is None:
            return None
        tracked.hits = list(got.hits)
        return start - tracked.local_tokens

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
            rows = (tracked.local_tokens, tracked.local_tokens + num_external_tokens)
            spec, family = params.recovery, params.family
            job = recovery_job(request, tracked, block_ids, rows, spec, family, self.block_size)
            self._recoveries.append(job)
            return
        tail_rows = 0 if tracked.tail is None else tracked.tail.end - tracked.tail.start
        self._load_hits(tracked, block_ids, (num_external_tokens - tail_rows) // self.block_size)
        self.tails.after_alloc(tracked, block_ids, num_external_tokens)

    def _load_hits(self, tracked: Tracked, block_ids: list[int], count: int) -> None:
        """Queue the first `count` store hits for the worker to load after the local hit."""
        first = tracked.local_tokens // self.block_size
        for i, hit in enumerate(tracked.hits[:count]):
            self._loads.append(LoadBlock(tracked.tenant, block_ids[first + i], hit))
            tracked.loaded_block_ids.add(block_ids[first + i])
        tracked.loaded_tokens = min(count, len(tracked.hits)) * self.block_size

    def _fill_base(
        self, request: Any, tracked: Tracked, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """An activated request's claim: its store hits load, the executor computes the rest
        (a full recovery job: exact base-model KV)."""
        self._load_hits(tracked, block_ids, num_external_tokens // self.block_size)
        start = tracked.local_tokens + tracked.loaded_tokens
        end = tracked.local_tokens + num_external_tokens
        if start < end:
            job = recovery_job(
                request, tracked, block_ids, (start, end), BASE_FILL, None, self.block_size
            )
            self._recoveries.append(job)

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
            led = self.store.led(request_id)
            if self.store.available and any((i + 1) * self.block_size <= done for i in led):
                block_ids = self._block_ids(request_id)[0]
                meta.saves += self.store.reserve(request_id, tracked, done, block_ids)
            if tracked.takes_tails and num_computed < len(tracked.prompt_ids) <= done:
                self.tails.prompt_computed(request_id, tracked, self._block_ids(request_id)[0])
        self.tails.take(meta)
        return meta

    def update_connector_output(self, saved: dict[TenantKey, int | None]) -> None:
        """The worker's copies of this step: committed (or abandoned) in the store."""
        self.store.saved(saved)

    def pin_transcripts(self, transcripts: dict[str, tuple[bytes, ...]]) -> None:
        """The worker published (or restored) these requests' transcripts: pin each for its
        family at its declared `next_use`, until the family ends. A request without a declared
        next use, or that finished in the step its recovery ran (its family membership ended
        with it), pins nothing."""
        for request_id, keys in transcripts.items():
            tracked = self._requests.get(request_id)
            if tracked is not None:
                self.store.pin_transcript(tracked, keys)

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
        kept_output = self._keep_output(request, tracked, block_ids)
        self.tails.finished(request, tracked, block_ids)
        self.store.finish(request.request_id, tracked)
        prompt = request.num_prompt_tokens
        stats: dict[str, Any] = {
            "prompt_tokens": prompt,
            "reused_tokens": tracked.local_tokens + tracked.tail_tokens,
            "restored_tokens": tracked.loaded_tokens,
            "recovered_tokens": tracked.recovered_tokens,
            "computed_tokens": prompt
            - tracked.local_tokens
            - tracked.tail_tokens
            - tracked.loaded_tokens
            - tracked.recovered_tokens,
            "family": None if tracked.params is None else tracked.params.family,
        }
        if tracked.activation is not None:
            stats["activation"] = {
                k: v for k, v in asdict(tracked.activation).items() if v is not None or k == "start"
            }
        if tracked.quality is not None:
            stats["quality"] = tracked.quality
        if tracked.recovery is not None:
            stats["recovery"] = tracked.recovery
        elif tracked.recovered_tokens:
            self._finishing[request.request_id] = stats  # its report comes in this same step
        if tracked.tail_tokens:
            stats["page_tail_tokens"] = tracked.tail_tokens  # of reused_tokens
        if kept_output:
            stats["kept_output_tokens"] = len(self._outputs[-1].token_ids)
        self._finished.append((stats, len(request.output_token_ids)))
        return kept_output, stats

    def take_finished(self) -> list[dict[str, Any]]:
        """Stats of the requests finished since the last call, each with completion_tokens (for
        vLLM's metrics: kmesh/vllm/metrics.py)."""
        finished = [{**stats, "completion_tokens": n} for stats, n in self._finished]
        self._finished = []
        return finished

    def _keep_output(self, request: Any, tracked: Tracked, block_ids: list[int]) -> bool:
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
            self.tails.load_failed(tracked, block_ids)
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
        self.store.close()

    # -- internals -------------------------------------------------------------------------

    def _track(self, request: Any) -> Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = self._tracker.track(request)
            self._requests[request.request_id] = tracked
        return tracked
