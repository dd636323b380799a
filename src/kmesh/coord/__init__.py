"""Future-use coordination: compute shared state once and keep it while it will be used again.

singleflight.py: one computation per missing key (claims, waiters, promotion, leases); pins.py:
entries kept for a (session, family); families.py: when a family's shared state may be let go;
retention.py: bounded memory of ended work. All bookkeeping, no I/O: callers pass `now`, and the
entries themselves live in a store tier (kmesh/store/state_machine.py drives these).
"""
