"""What engines share through the store: the store's side of recovery/shared.py.

group_state.py is the entries' format (a round's master, transcript pieces, first readers'
segments) and their fetch and publish; masters.py shares rounds' masters, transcripts.py jobs'
transcripts; state.py wires them, with first readers' segments, into recovery's SharedState
(`shared_through`, called by both engines).
"""
