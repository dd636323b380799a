"""TenantClients keeps at most max_open connections open, closing only clients that hold nothing
the store ties to their connection (kmesh/store/tenant_clients.py), against a real store."""

import time

from kmesh.store import TenantClients
from kmesh.store.tenant_clients import MAX_OPEN_CLIENTS
from tests.store.helpers import chain, digest, payload_for, read_digest


def open_connections(store) -> int:
    """The store's open connections, less the one asking."""
    with store.client() as asking:
        return asking.stats()["connections"] - 1


def test_two_hundred_salts_leave_at_most_max_open_connections(store):
    clients = TenantClients(store.socket)
    for i in range(200):
        salt = f"salt-{i}"
        assert clients(salt).lookup(chain(1, seed=i, tenant=salt)) == []
    assert open_connections(store) == MAX_OPEN_CLIENTS
    assert clients.num_open == MAX_OPEN_CLIENTS
    clients.close()


def test_a_salt_used_again_after_its_client_was_closed_reads_what_it_published(store):
    clients = TenantClients(store.socket, max_open=4)
    keys = chain(2, seed=1, tenant="first")
    first = clients("first")
    for key in first.acquire(keys).lead:
        first.publish(key, payload_for(key))
    for i in range(10):
        clients(f"other-{i}").lookup(keys)
    again = clients("first")
    assert again is not first
    got = again.acquire(keys)
    assert [read_digest(again, hit) for hit in got.hits] == [digest(payload_for(k)) for k in keys]
    assert open_connections(store) == 4
    clients.close()


def test_a_client_that_holds_a_pin_is_not_closed(store):
    clients = TenantClients(store.socket, max_open=2)
    keys = chain(1, seed=2, tenant="pinned")
    pinned = clients("pinned")
    pinned.publish(pinned.acquire(keys).lead[0], payload_for(keys[0]))
    assert pinned.pin("family", keys) == 1
    for i in range(10):
        clients(f"other-{i}").lookup(keys)
    assert clients("pinned") is pinned
    assert pinned.stats()["pinned"] == 1
    assert open_connections(store) == 2
    assert pinned.close_family("family") == 1
    clients("one-more").lookup(keys)
    clients("and-another").lookup(keys)
    assert clients("pinned") is not pinned  # nothing held any more: closed as the oldest
    clients.close()


def test_a_client_that_leads_a_claim_is_not_closed_and_publishes_it_later(store):
    clients = TenantClients(store.socket, max_open=2)
    keys = chain(1, seed=3, tenant="leader")
    leader = clients("leader")
    assert leader.acquire(keys).lead == tuple(keys)
    for i in range(10):
        clients(f"other-{i}").lookup(keys)
    assert clients("leader") is leader
    leader.publish(keys[0], payload_for(keys[0]))  # the claim is still this connection's
    assert not leader.holding
    clients.close()


def test_when_every_client_holds_something_the_cap_is_exceeded(store):
    clients = TenantClients(store.socket, max_open=2)
    leaders = []
    for i in range(3):
        salt = f"leader-{i}"
        leaders.append(clients(salt))
        assert leaders[-1].acquire(chain(1, seed=i, tenant=salt)).lead
    assert clients.num_open == 3
    assert open_connections(store) == 3
    assert [clients(f"leader-{i}") for i in range(3)] == leaders
    clients.close()


def test_holding_follows_pins_claims_and_the_lease(store_factory):
    store = store_factory(lease=0.5)
    keys = chain(2, seed=4)
    with store.client() as client:
        assert not client.holding
        got = client.acquire(keys)
        assert got.lead == tuple(keys) and client.holding
        client.publish(keys[0], payload_for(keys[0]), family="f")
        client.abandon(keys[1:])
        assert client.holding  # the family's pin
        client.close_family("f")
        assert not client.holding
        client.acquire(keys[1:])
        assert client.holding
        time.sleep(0.6)  # the lease ran out: the store let the claim go
        assert not client.holding
        with store.client() as other:
            assert other.acquire(keys[1:]).lead == tuple(keys[1:])
