"""The remote tier behind the local one: stores on several machines share entries through
Mooncake Store (docs/design/remote-tier.md).

front.py is what the local store (state_machine.py) asks of the remote tier and does with the
answers (no I/O); worker.py is the thread that carries those commands out; mooncake_tier.py holds
the bytes and claim records in Mooncake Store; leases.py tells a live remote claim from a dead one.
"""
