"""`kmesh bench council`'s council, small: AutoGen AgentChat (unmodified, in the client venv)
against `kmesh serve --engine reference`, exact and with --reuse-messages."""

import pytest

from kmesh.bench.council.run import CouncilConfig, client_python, run_council
from kmesh.serve.process import start_kmesh_serve

pytestmark = pytest.mark.model

CFG = CouncilConfig(agents=3, rounds=2, max_tokens=12)


def council(tmp_path, options):
    server = start_kmesh_serve("reference", tmp_path / "serve.log", options)
    try:
        rounds = run_council(
            client_python(None), server.url, "SmolLM2-135M-Instruct", CFG, tmp_path
        )
    finally:
        log = server.stop()
    assert "Traceback" not in log, log
    assert log.count(" 200 ") == CFG.agents * CFG.rounds, log  # every request served
    return rounds


def test_an_unmodified_autogen_council_reuses_other_agents_messages_with_reuse_messages(tmp_path):
    exact = council(tmp_path, ())
    reused = council(tmp_path, ("--reuse-messages",))
    for rounds in (exact, reused):
        assert [len(r.messages) for r in rounds] == [CFG.agents] * CFG.rounds
        assert [m["source"] for m in rounds[0].messages] == ["member_0", "member_1", "member_2"]
        assert all(m["content"] for r in rounds for m in r.messages)
    # Exact: what is not reused from the prefix cache is computed, nothing recovered.
    for r in exact:
        assert r.counters["recovered"] == 0
        assert r.counters["computed"] == r.counters["prompt"] - r.counters["reused"]
    # Reuse: the task and the others' messages are recovered where they now sit, for less.
    for a, b in zip(exact, reused, strict=True):
        assert b.counters["recovered"] > 0
        assert b.counters["computed"] < a.counters["computed"]
