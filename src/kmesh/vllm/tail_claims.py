"""Tail claims of the connector's scheduler half: the rows of a partly used page that an earlier
request of this engine computed, claimed after vLLM's local hit (and the store's blocks) and
copied by the worker half from the tail it keeps (page_tails.py has the index and its invariants).

- When a request's prompt has been computed (the step that computes its last prompt token), the
  rows of its last page are filed; the worker reads them after that step's forward pass.
- When a request finishes, the rows of its last page past its prompt are filed; the worker
  reads them from the block vLLM has just freed, during the next step, if that step's
  scheduling left the block free (so nothing writes it in that step: vLLM writes only blocks it
  allocated); if it did not, the tail is dropped. That needs steps that run one after another:
  under vLLM's asynchronous scheduling (never on CPU) finished requests file none.
- A later request takes the rows its tokens share with a filed tail right after its hits, up to
  its prompt's last token: a fork's branches then compute only that token, and a continuation
  only what its parent did not compute.
- Only plain requests file or take tails: no LoRA adapter, no recovery. A recovering request
  fills its own claim (recovery/prefix_tails.py), and its rows may be approximate.
- A tail the worker could not copy comes back as a load error; vLLM computes those rows.
"""

from collections.abc import Callable
from typing import Any

from kmesh.state.keys import BlockHash, KeyNamespace, block_key, extend_block_keys
from kmesh.vllm.metadata import CopyTail, KeepTail, KMeshConnectorMetadata
from kmesh.vllm.page_tails import DEFAULT_TAIL_BYTES, PageTails, TailHit
from kmesh.vllm.tracked import Tracked


class TailClaims:
    """The scheduler half's page tails: what it files, what requests claim, what the worker
    keeps, copies and drops each step (`take`)."""

    def __init__(
        self,
        fingerprint: str,
        block_size: int,
        row_bytes: int,
        finished_tails: bool = True,
        budget_bytes: int = DEFAULT_TAIL_BYTES,
    ) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.finished_tails = finished_tails
        self.tails = PageTails(row_bytes, budget_bytes)
        self._copies: list[CopyTail] = []
        self._prompt_tails: list[KeepTail] = []
        self._finished_tails: list[KeepTail] = []
        self._block_is_free: Callable[[int], bool] = lambda block_id: False

    def bind_block_pool(self, block_is_free: Callable[[int], bool]) -> None:
        """Whether a block of vLLM's KV cache is free (held by no request) now."""
        self._block_is_free = block_is_free

    def claim(self, request: Any, tracked: Tracked, start: int) -> int:
        """Rows a kept tail gives `request` from `start` (a page start: the end of its hits) up to
        its prompt's last token; 0 for none."""
        tracked.tail = None
        if not tracked.takes_tails or start % self.block_size:
            return 0
        keys = tracked.keys[: start // self.block_size]
        if len(keys) * self.block_size != start:
            return 0
        anchor = self._anchor(request.cache_salt, keys)
        end = request.num_prompt_tokens - 1
        hit = self.tails.find(anchor, request.prompt_token_ids, start, end)
        tracked.tail = hit
        return 0 if hit is None else hit.end - hit.start

    def after_alloc(self, tracked: Tracked, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the copy of the claimed tail rows, if the claim reached them."""
        hit: TailHit | None = tracked.tail
        if hit is None or tracked.local_tokens + num_external_tokens < hit.end:
            tracked.tail = None
            return
        self._copies.append(CopyTail(hit.tail_id, block_ids, hit.start, hit.end))
        tracked.tail_tokens = hit.end - hit.start
        tracked.tail_block_id = block_ids[hit.start // self.block_size]

    def prompt_computed(self, request_id: str, tracked: Tracked, block_ids: list[int]) -> None:
        """File the last page of a prompt computed this step (the worker reads it after the
        forward pass)."""
        tail = self._file(tracked, tracked.prompt_ids, len(tracked.prompt_ids))
        if tail is not None:
            tail_id, start, end = tail
            self._prompt_tails.append(KeepTail(tail_id, block_ids, start, end))

    def finished(self, request: Any, tracked: Tracked, block_ids: list[int]) -> None:
        """File the last page of a finished request's computed rows past its prompt (read from
        its freed block in the next step, if that step leaves the block free: `take`)."""
        computed = request.num_computed_tokens
        if not self.finished_tails or computed <= len(tracked.prompt_ids):
            return
        tail = self._file(tracked, request.all_token_ids, computed)
        if tail is not None:
            tail_id, start, end = tail
            self._finished_tails.append(KeepTail(tail_id, block_ids, start, end))

    def take(self, meta: KMeshConnectorMetadata) -> None:
        """Hand this step's copies, keeps and drops to the worker."""
        meta.tail_copies, self._copies = self._copies, []
        meta.prompt_tails, self._prompt_tails = self._prompt_tails, []
        for keep in self._finished_tails:  # the freed block, unless this step took it again
            if self._block_is_free(keep.block_ids[keep.start // self.block_size]):
                meta.finished_tails.append(keep)
            else:
                self.tails.drop(keep.tail_id)
        self._finished_tails = []
        meta.dropped_tails = self.tails.take_dropped()

    def clear(self) -> None:
        """Drop every tail (the worker frees their rows in the next step)."""
        self.tails.clear()

    def load_failed(self, tracked: Tracked, block_ids: set[int]) -> None:
        if tracked.tail_block_id in block_ids:
            tracked.tail_tokens, tracked.tail_block_id = 0, None

    def _file(self, tracked: Tracked, token_ids: Any, computed: int) -> tuple[int, int, int] | None:
        """File rows [page start, computed) of a request that takes tails: (tail id, start, end)."""
        if not tracked.takes_tails or computed <= 0:
            return None
        start = (computed - 1) // self.block_size * self.block_size
        keys = list(tracked.keys[: start // self.block_size])
        namespace = KeyNamespace(self.fingerprint, None, tracked.tenant)
        extend_block_keys(keys, namespace, token_ids[:start], self.block_size)
        tail_id = self.tails.file(self._anchor(tracked.tenant, keys), start, token_ids[:computed])
        return None if tail_id is None else (tail_id, start, computed)

    def _anchor(self, salt: str | None, keys: list[BlockHash]) -> BlockHash:
        """The key of the whole pages before a tail (the namespace's own key before the first)."""
        if keys:
            return keys[-1]
        return block_key(KeyNamespace(self.fingerprint, None, salt), None, ())
