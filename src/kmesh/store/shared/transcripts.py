"""Recovery jobs' transcripts through the store, for either engine (recovery/requests.py's
SharedTranscripts): what one engine recovered, another engine (or this one, after its prefix cache
let it go) restores instead of recovering it again.

A job's transcript is its prompt up to its last segment's start: what its member's next prompt
continues. It is held as a chain of pieces (group_state.py), each ending at one of the job's
boundaries (recovery/prefix_tails.py::boundaries: the family trunk's end, a chat's last message's
start, the last segment's start) and keyed through the piece before it (state/keys.py::piece_key)
in the job's tenant's namespace. So a trunk is one entry for every member, and each later job
adds pieces of its new rows (a chat's ask is a piece of its own, which a round's next prompt
leaves out).

Finding (`restore`): a job walks its chain from the prompt's first token; at each step the
candidate ends are its own segment boundaries after the chain's end, inside its claim; one
`lookup` names the published ones; the furthest is taken. Pieces that end after the job's start
(its local prefix hit holds the rest) are read, with their masters, and restored
(`restore_piece`: bit-identical to what was published, or refused); from the first piece lost
(evicted, corrupt, refused) on, the job recovers the rows itself.

Publishing (`publish`, after the job's rows are in the engine's pages): the rows from the chain's
end to each boundary the job wrote are read back from the pages and published as one piece:
mirrored (the job's mirrors of its round's master that lie inside it, naming the master's store
entry: StoreMasters.key) when restoring it gives those rows back (known where the mirrors' diffs
were taken from those rows: RoundMirrors.gives_back_from, a mirror's blocks that reach before it,
into the job's prefix, joining its diff; checked otherwise), dense otherwise.
It returns the keys of the entries the job's next prompt reads (its chain's pieces and its
round's master); the engine pins them for the job's family at its declared next use, if it
declared one (the pins are the scheduler's: they end with the family). Undeclared, pieces are
left to the store's retention as unpinned entries (LRU among them).

Pieces are served to any job under their tenant's salt, as an engine's prefix cache serves its
pages: a job's gate judges the rows it recovers, not the rows it restores.

Every store failure is a miss or a piece not kept; the job computes what it lacks.
"""

import logging

import torch

from kmesh.kv.master_mirror import Master, Mirror
from kmesh.recovery.jobs import PrefixReader, RecoveryJob, RoundMirrors
from kmesh.recovery.prefix_tails import boundaries
from kmesh.recovery.shared import Chain, Restored
from kmesh.state.keys import KeyNamespace, piece_key
from kmesh.store.client import StoreClient
from kmesh.store.errors import StoreError
from kmesh.store.protocol import MAX_KEYS
from kmesh.store.shared.group_state import (
    Piece,
    PieceMismatch,
    fetch,
    gives_back,
    piece_payload,
    publish,
    read_piece,
    restore_piece,
)
from kmesh.store.shared.master_blocks import ReadMasters
from kmesh.store.shared.masters import StoreMasters

log = logging.getLogger(__name__)


class StoreTranscripts:
    """Jobs' transcripts in the store (see the module docstring); masters through `masters`."""

    def __init__(self, masters: StoreMasters) -> None:
        self.masters = masters
        self.clients = masters.clients
        self.fingerprint = masters.fingerprint
        self.config = masters.config
        # The masters read last, by store key: a round's members restored here read each of
        # their blocks once.
        self._read_masters = ReadMasters(self.config)

    def restore(self, job: RecoveryJob, have: int) -> Restored:
        """The job's transcript as far as the store holds it, and its rows after job.start if
        it reaches past `have` (the engine holds the rows before that: nothing is read)."""
        chain = Chain()
        try:
            chain = self._find(job)
            if chain.end <= have:
                return Restored(chain, None, None)
            return self._read(job, chain)
        except StoreError as error:
            log.info("kmesh: transcript of %s not restored: %s", job.request_id, error)
            return Restored(chain, None, None)

    def publish(
        self, job: RecoveryJob, chain: Chain, pages: PrefixReader, mirrors: RoundMirrors | None
    ) -> tuple[bytes, ...]:
        """Publish the job's rows from `chain`'s end to each of its boundaries it wrote (rows
        [0, job.end) are in `pages` now); the keys of its transcript's entries (`chain`'s
        pieces, the pieces after it, its round's master)."""
        client = self.clients(job.tenant)
        namespace = self._namespace(job)
        keys = list(chain.keys)
        master = None  # the store key of the round's master the job's mirrors read
        if mirrors is not None:
            master = self.masters.key(mirrors.round, mirrors.master_choice, mirrors.tokens)
            keys.append(master)
        parent = chain.keys[-1] if chain.keys else None
        start = chain.end
        try:
            for end in boundaries(job):
                if end <= start or end > job.end:
                    continue
                key = piece_key(namespace, parent, job.token_ids[start:end])
                if client.acquire([key]).lead:
                    self._publish_piece(client, key, job, (start, end), pages, mirrors, master)
                keys.append(key)
                parent, start = key, end
        except StoreError as error:
            log.info("kmesh: transcript of %s not published: %s", job.request_id, error)
        return tuple(keys)

    def _publish_piece(
        self,
        client: StoreClient,
        key: bytes,
        job: RecoveryJob,
        rows: tuple[int, int],
        pages: PrefixReader,
        mirrors: RoundMirrors | None,
        master: bytes | None,
    ) -> None:
        """Publish the led `key`: the job's rows [start, end) read back from `pages`. Anything
        but a store error while building it gives the key up and is raised as one."""
        try:
            k, v = pages.read(job.block_ids, torch.arange(*rows))
            payload = piece_payload(self._piece(rows[0], k, v, mirrors, master))
        except Exception as error:  # a piece is an optimisation: never fatal to the job
            client.abandon([key])
            raise StoreError(f"piece [{rows[0]}, {rows[1]}) not built: {error}") from None
        publish(client, key, payload)

    # -- internals -------------------------------------------------------------------------

    def _namespace(self, job: RecoveryJob) -> KeyNamespace:
        return KeyNamespace(self.fingerprint, tenant_salt=job.tenant)

    def _find(self, job: RecoveryJob) -> Chain:
        """The longest chain of published pieces ending at the job's segment boundaries."""
        client = self.clients(job.tenant)
        namespace = self._namespace(job)
        ends = sorted({b for s in job.spans for b in (s.start, s.end) if 0 < b < job.end})
        chain = Chain()
        while True:
            candidates = [b for b in ends if b > chain.end]
            parent = chain.keys[-1] if chain.keys else None
            keys = [piece_key(namespace, parent, job.token_ids[chain.end : b]) for b in candidates]
            present: list[int] = []
            for lo in range(0, len(keys), MAX_KEYS):
                present += [lo + i for i in client.lookup(keys[lo : lo + MAX_KEYS])]
            if not present:
                return chain
            furthest = max(present)
            chain = chain.then(keys[furthest], candidates[furthest])

    def _read(self, job: RecoveryJob, chain: Chain) -> Restored:
        """Restore the chain's pieces that end after job.start; the chain cut before the first
        that cannot be."""
        client = self.clients(job.tenant)
        first = next((i for i, end in enumerate(chain.ends) if end > job.start), len(chain.ends))
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        nbytes = 0
        kept = first
        for i in range(first, len(chain.keys)):
            try:
                (k, v), size = self._piece_rows(client, chain.keys[i])
            except StoreError as error:  # PieceMismatch included
                log.info("kmesh: a piece of %s's transcript is lost: %s", job.request_id, error)
                break
            start = chain.ends[i - 1] if i else 0
            skip = max(0, job.start - start)
            ks.append(k[:, skip:])
            vs.append(v[:, skip:])
            nbytes += size
            kept = i + 1
        chain = Chain(chain.keys[:kept], chain.ends[:kept])
        if not ks:
            return Restored(chain, None, None, nbytes)
        return Restored(chain, torch.cat(ks, dim=1), torch.cat(vs, dim=1), nbytes)

    def _piece_rows(
        self, client: StoreClient, key: bytes
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """A piece's rows, checked, and the bytes read for them."""
        fetched = fetch(client, key, read_piece)
        if fetched is None:
            raise StoreError("the piece was evicted")
        piece, size = fetched
        master = None
        if piece.master is not None:
            master, master_size = self._read_masters.for_piece(client, piece)
            size += master_size
        try:
            return restore_piece(piece, master, self.config), size
        except PieceMismatch:
            if piece.master is not None:  # a master replaced since: read it again next time
                self._read_masters.forget(piece.master)
            raise

    def _piece(
        self,
        start: int,
        k: torch.Tensor,
        v: torch.Tensor,
        mirrors: RoundMirrors | None,
        master: bytes | None,
    ) -> Piece:
        """Rows k, v from `start` as a piece: mirrored (naming the `master` entry) where the
        job's mirrors inside it give exactly these rows back, dense otherwise."""
        end = start + k.shape[1]
        if mirrors is not None and master is not None:
            inside = [
                m
                for m in mirrors.mirrors
                if m.positions.numel() and start <= m.positions.min() and m.positions.max() < end
            ]
            if inside:
                known = mirrors.gives_back_from
                if known is not None:
                    inside = [_diffed_before(m, known, mirrors.master, start, k, v) for m in inside]
                piece = Piece.of(start, k, v, inside, master)
                if known is not None or gives_back(piece, mirrors.master, self.config, k, v):
                    return piece
                log.info("kmesh: mirrors do not give the rows back; the piece is dense")
        return Piece.of(start, k, v)


def _diffed_before(
    mirror: Mirror, known: int, master: Master, start: int, k: torch.Tensor, v: torch.Tensor
) -> Mirror:
    """`mirror` giving back the piece's rows k, v (from `start`) bit for bit, where it gives back
    those at or after `known` (RoundMirrors.gives_back_from): its tokens before `known` lie in
    rows the job did not write (its prefix, which the engine computed), so the blocks holding
    them join its diff, taken from these rows. Its other diff blocks hold the job's rows, which
    these rows are."""
    early = mirror.positions < known
    if not bool(early.any()):
        return mirror
    blocks = torch.cat((mirror.diff_index, mirror.block_of_token()[early]))
    rows = mirror.rows(start)
    return mirror.with_diff(master, k[:, rows], v[:, rows], blocks)
