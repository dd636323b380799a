"""Jobs' transcripts through a real store (kmesh/store/shared/transcripts.py): published by one job,
found and restored bit-identically by a later one that continues it, mirrored where mirrors give
the rows back, cut at the first piece lost, never across tenants."""

from dataclasses import replace

import torch

from kmesh.compute.config import ModelConfig
from kmesh.compute.tiny import TINY_HF_CONFIG
from kmesh.kv.master_mirror import Master, MasterSegment, Mirror, kv_digest
from kmesh.kv.mirror_restore import restore
from kmesh.recovery.continuations import Continuations
from kmesh.recovery.jobs import RecoveredRows, RecoveryJob, RecoveryReport, RoundKey, RoundMirrors
from kmesh.recovery.ledger import Ledger
from kmesh.recovery.shared import Chain, Restored
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.state.segments import Role, Span
from kmesh.store import TenantClients
from kmesh.store.shared import group_state, transcripts
from kmesh.store.shared.group_state import read_piece
from kmesh.store.shared.masters import StoreMasters
from kmesh.store.shared.transcripts import StoreTranscripts
from tests.conftest import random_tokens
from tests.store.helpers import corrupt_segment

CONFIG = ModelConfig.from_hf(TINY_HF_CONFIG)
LAYERS, HEADS, DIM = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim
SALT = "kmesh-approx:t"
PARTS = {
    "system": random_tokens(20, seed=1),
    "persona": random_tokens(10, seed=2),
    "a": random_tokens(24, seed=3),
    "b": random_tokens(17, seed=4),
    "ask": random_tokens(5, seed=5),
    "ask2": random_tokens(6, seed=6),
}
ROLES = {"system": "shared", "persona": "private", "ask": "instruction", "ask2": "instruction"}


def _job(
    names: list[str], start: int, tenant: str | None = SALT, request: str = "r"
) -> RecoveryJob:
    ids: list[int] = []
    spans = []
    for name in names:
        role = Role(ROLES.get(name, "shared"))
        spans.append(Span(len(ids), len(ids) + len(PARTS[name]), role, name))
        ids.extend(PARTS[name])
    spec = RecoverySpec(policy="none", gate=None)
    return RecoveryJob(request, ids, [], start, len(ids) - 1, tenant, spans, spec, "council")


class _Pages:
    """An engine's pages as rows by position."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
        self.v = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)

    def read(self, block_ids, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, positions], self.v[:, positions]


def _transcripts(store) -> StoreTranscripts:
    return StoreTranscripts(StoreMasters(TenantClients(store.socket), "f" * 64, CONFIG))


def _restore(store, job: RecoveryJob, have: int | None = None):
    """What a fresh engine restores for `job` (holding its rows up to `have`: its start)."""
    return _transcripts(store).restore(job, job.start if have is None else have)


def test_a_later_job_restores_the_transcript_an_earlier_job_published_bit_for_bit(store):
    first = _job(["system", "persona", "a", "ask"], start=0)
    pages = _Pages(len(first.token_ids), seed=7)
    _transcripts(store).publish(first, Chain(), pages, None)
    # The next prompt continues the transcript (everything before "ask"), its local hit 32 rows.
    later = _job(["system", "persona", "a", "b", "ask2"], start=32)
    got = _restore(store, later)
    assert got.chain.ends == (20, 54)  # the trunk, then the member's rows to its last segment
    assert got.k is not None and got.v is not None and got.nbytes > 0
    assert torch.equal(got.k, pages.k[:, 32:54]) and torch.equal(got.v, pages.v[:, 32:54])
    # Another member shares the trunk entry: its chain finds it, nothing of the first member's.
    member = _job(["system", "b", "ask"], start=0)
    assert _restore(store, member).chain.ends == (20,)


def test_a_job_after_its_whole_transcript_in_its_prefix_reads_no_piece(store):
    first = _job(["system", "persona", "a", "ask"], start=0)
    _transcripts(store).publish(first, Chain(), _Pages(len(first.token_ids), seed=7), None)
    got = _restore(store, _job(["system", "persona", "a", "b", "ask2"], start=64))
    assert got.chain.ends == (20, 54) and got.k is None and got.nbytes == 0
    # Nor one whose engine holds the rows past its start (a kept tail): the chain is all it gets.
    got = _restore(store, _job(["system", "persona", "a", "b", "ask2"], start=32), have=54)
    assert got.chain.ends == (20, 54) and got.k is None and got.nbytes == 0


def _mirrored(store, job: RecoveryJob) -> tuple[_Pages, StoreMasters, RoundMirrors]:
    """Pages whose rows of "a" and "b" are a round's master's, placed by the job's mirror; the
    master published."""
    pages = _Pages(len(job.token_ids), seed=8)
    # The round's master holds "a" and "b"; this job's rows there are the master's, placed.
    segments = []
    for name, lo in (("a", 30), ("b", 54)):
        rows = torch.arange(lo, lo + len(PARTS[name]))
        segments.append(MasterSegment(pages.k[:, rows], pages.v[:, rows], rows + 100))
    master = Master.build(segments, 8, CONFIG)
    mirror = Mirror.of(master, (0, 1), 30)
    pages.k[:, 30:71], pages.v[:, 30:71] = restore(master, mirror, CONFIG)
    tokens = tuple(PARTS["a"] + PARTS["b"])
    round_key = RoundKey(SALT, "council", "r1")
    masters = StoreMasters(TenantClients(store.socket), "f" * 64, CONFIG)
    masters.put(round_key, "sibling", tokens, master)
    return pages, masters, RoundMirrors(round_key, "sibling", tokens, master, (mirror,))


def test_mirrors_that_give_the_rows_back_are_published_instead_of_the_rows(store):
    job = _job(["system", "persona", "a", "b", "ask2"], start=0)
    pages, masters, mirrors = _mirrored(store, job)
    StoreTranscripts(masters).publish(job, Chain(), pages, mirrors)
    reader = _transcripts(store)
    got = reader.restore(_job(["system", "persona", "a", "b", "ask"], start=0), 0)
    assert got.k is not None and torch.equal(got.k, pages.k[:, :71])
    # Another member of the round restored on the same engine: the master is not read again.
    again = reader.restore(_job(["system", "persona", "a", "b", "ask"], start=0, request="s"), 0)
    assert again.k is not None and torch.equal(again.k, got.k)
    assert again.nbytes < got.nbytes
    with store.client(tenant=SALT) as client:
        hit = client.acquire([got.chain.keys[1]]).hits[0]
        with client.read(hit) as entry:
            piece = read_piece(entry.data)
    assert len(piece.mirrors) == 1 and piece.dense_positions.tolist() == list(range(20, 30))
    # Mirrors that do not give the rows back (the rows changed since): the piece is dense.
    other = _job(["system", "persona", "a", "b", "ask2"], start=0, tenant="kmesh-approx:u")
    pages.k[:, 40] += 1
    StoreTranscripts(masters).publish(other, Chain(), pages, mirrors)
    got = _restore(store, _job(["system", "persona", "a", "b", "ask"], 0, other.tenant))
    assert got.k is not None and torch.equal(got.k, pages.k[:, :71])


def test_a_mirrored_piece_is_hashed_once_when_it_is_published(store, monkeypatch):
    job = _job(["system", "persona", "a", "b", "ask2"], start=0)
    pages, masters, mirrors = _mirrored(store, job)
    hashed: list[int] = []

    def counted(k: torch.Tensor, v: torch.Tensor) -> str:
        hashed.append(k.shape[1])
        return kv_digest(k, v)

    monkeypatch.setattr(group_state, "kv_digest", counted)
    StoreTranscripts(masters).publish(job, Chain(), pages, mirrors)
    assert hashed == [20, 51]  # the trunk (dense), then the member's mirrored piece: once each


def _count_checks(monkeypatch) -> list[int]:
    """The start of every piece the publisher checks with gives_back, as it checks them."""
    checked: list[int] = []
    real = group_state.gives_back

    def counted(piece, master, config, k, v) -> bool:
        checked.append(piece.start)
        return real(piece, master, config, k, v)

    monkeypatch.setattr(transcripts, "gives_back", counted)
    return checked


def test_mirrors_known_to_give_the_rows_back_are_published_unchecked_and_others_checked(
    store, monkeypatch
):
    job = _job(["system", "persona", "a", "b", "ask2"], start=0)
    pages, masters, mirrors = _mirrored(store, job)
    checked = _count_checks(monkeypatch)
    known = replace(mirrors, gives_back_from=30)  # the mirror starts at 30: its diff is the rows
    StoreTranscripts(masters).publish(job, Chain(), pages, known)
    assert checked == []
    got = _restore(store, _job(["system", "persona", "a", "b", "ask"], start=0))
    assert got.k is not None and torch.equal(got.k, pages.k[:, :71])
    # The master sibling's mirrors (gives_back_from None, keys turned by 0) are checked.
    other = _job(["system", "persona", "a", "b", "ask2"], start=0, tenant="kmesh-approx:u")
    StoreTranscripts(masters).publish(other, Chain(), pages, mirrors)
    assert checked == [20]


def test_a_mirror_reaching_into_the_prefix_keeps_the_prefix_rows_in_its_diff(store, monkeypatch):
    job = _job(["system", "persona", "a", "b", "ask2"], start=0)
    pages, masters, mirrors = _mirrored(store, job)
    # Rows 30-33 lie in the job's prefix (the engine computed them): not the master's, placed.
    pages.k[:, 30:34] += 0.5
    checked = _count_checks(monkeypatch)
    StoreTranscripts(masters).publish(job, Chain(), pages, replace(mirrors, gives_back_from=34))
    assert checked == []  # known past the prefix's blocks, which join the diff
    got = _restore(store, _job(["system", "persona", "a", "b", "ask"], start=0))
    assert got.k is not None and torch.equal(got.k, pages.k[:, :71])
    assert torch.equal(got.v, pages.v[:, :71])
    with store.client(tenant=SALT) as client:
        hit = client.acquire([got.chain.keys[1]]).hits[0]
        with client.read(hit) as entry:
            piece = read_piece(entry.data)
    [mirror] = piece.mirrors  # mirrored still, the prefix's block in its diff
    assert mirror.diff_index.tolist() == [0]
    assert piece.dense_positions.tolist() == list(range(20, 30))


def test_a_corrupted_piece_cuts_the_chain_and_the_job_computes_from_there(store):
    first = _job(["system", "persona", "a", "ask"], start=0)
    _transcripts(store).publish(first, Chain(), _Pages(len(first.token_ids), seed=7), None)
    later = _job(["system", "persona", "a", "b", "ask2"], start=0)
    found = _restore(store, later)
    with store.client(tenant=SALT) as client:
        hit = client.acquire([found.chain.keys[1]]).hits[0]
    corrupt_segment(hit.name, offset=hit.size - 3)
    got = _restore(store, later)
    assert got.chain.ends == (20,)  # the trunk only: the member's piece was dropped
    assert got.k is not None and got.k.shape[1] == 20


def test_a_transcript_is_never_found_under_another_tenant(store):
    first = _job(["system", "persona", "a", "ask"], start=0)
    _transcripts(store).publish(first, Chain(), _Pages(len(first.token_ids), seed=7), None)
    for tenant in (None, "kmesh-approx:other"):
        got = _restore(store, _job(["system", "persona", "a", "ask"], 0, tenant))
        assert got.chain == Chain() and got.k is None


def test_a_job_publishes_the_rows_it_wrote_from_its_outcome_and_its_prefix_from_its_pages(store):
    """Continuations.write publishes right after handing the rows to the engine: the rows it
    wrote come from the outcome (the same bits), not read back; the prefix from the pages."""
    first = _job(["system", "persona", "a", "ask"], start=20)
    pages = _Pages(len(first.token_ids), seed=7)
    pages.k[:, 20:] = float("nan")  # what a read of the written rows would publish
    gen = torch.Generator().manual_seed(8)
    n = first.end - first.start
    k = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
    v = torch.randn(LAYERS, n, HEADS, DIM, generator=gen)
    report = RecoveryReport(0.0, 0.0, 0, 0, 0, None, False)
    steps = Continuations(Ledger(1 << 20), lambda key, nbytes: None, None)
    steps.transcripts = _transcripts(store)
    written = []
    restored = {first.request_id: Restored(Chain(), None, None)}
    out = steps.write(
        first, RecoveredRows(report, k, v), pages, lambda *a: written.append(a), restored
    )
    assert len(written) == 1 and out.transcript
    got = _restore(store, _job(["system", "persona", "a", "b", "ask2"], start=0))
    assert got.chain.ends == (20, 54) and got.k is not None and got.v is not None
    assert torch.equal(got.k[:, :20], pages.k[:, :20]) and torch.equal(got.v[:, 20:], v[:, :34])
    assert torch.equal(got.k[:, 20:], k[:, :34])
