"""`kmesh bench agents` (src/kmesh/bench/agents.py) on the reference engine: two agents, two
rounds, every strategy, one run shared by the module (about 30 s); the request bodies and the
summary's rules without a server."""

import pytest
from rich.console import Console

from kmesh.bench.agents.config import STRATEGIES, AgentsBenchConfig
from kmesh.bench.agents.report import plot, print_report
from kmesh.bench.agents.requests import RunNames, request_body
from kmesh.bench.agents.run import kmesh_serve_options, run_agents_bench
from kmesh.bench.agents.summary import _kv_pages, _max_under_slo, agents_report
from kmesh.cli import build_parser
from kmesh.errors import InvalidRequestError
from kmesh.workloads.agent_chats import AgentChats, AgentsConfig, task_facts
from kmesh.workloads.tasks import NAMES


@pytest.fixture(scope="module")
def report():
    cfg = AgentsBenchConfig(agents=(2,), rounds=2, max_tokens=6, engine="reference")
    return run_agents_bench(cfg, log=lambda _: None)


@pytest.mark.model
def test_every_strategy_answers_every_call_of_every_round(report):
    assert set(report["strategies"]) == set(STRATEGIES)
    for strategy in report["strategies"].values():
        figures = strategy["by_agents"]["2"]
        assert figures["failures"] == []
        assert [len(texts) for texts in figures["texts"]] == [2, 2]
        assert figures["makespan_s"] == pytest.approx(sum(figures["round_makespan_s"]))
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
        assert all(c > 0 for c in figures["computed_tokens"])
        assert strategy["max_agents_under_slo"] in (0, 2)
        assert all(cpu["server"] > 0 and cpu["total"] >= cpu["server"] for cpu in figures["cpu_s"])
    assert all(
        "store" in cpu for cpu in report["strategies"]["kmesh_exact"]["by_agents"]["2"]["cpu_s"]
    )


@pytest.mark.model
def test_exact_kmesh_and_plain_serving_say_the_same_concurrently_and_one_at_a_time(report):
    exact = report["strategies"]["kmesh_exact"]["by_agents"]["2"]
    assert exact["identical_to_vllm"] == [1.0, 1.0]
    assert exact["serial_check"] == {"calls": 4, "different": []}
    plain = report["strategies"]["vllm"]["by_agents"]["2"]
    assert plain["serial_check"] == {"calls": 4, "different": []}


@pytest.mark.model
def test_a_collective_round_builds_its_master_once_and_computes_less(report):
    collective = report["strategies"]["kmesh_collective"]["by_agents"]["2"]
    plain = report["strategies"]["vllm"]["by_agents"]["2"]
    assert collective["masters_built"] == [0, 1]  # round 0 declares no round
    assert collective["recovered_tokens"][1] > 0
    assert collective["computed_tokens"][1] < plain["computed_tokens"][1]
    assert report["strategies"]["kmesh_exact"]["by_agents"]["2"]["masters_built"] == [0, 0]


def bodies(strategy: str) -> list[list[dict]]:
    cfg = AgentsBenchConfig(agents=(3,), engine="reference")
    chats = AgentChats(cfg.chats(3), str.split)
    names = RunNames(strategy, "run-1", 3, cfg.rounds)
    rounds = []
    for r in range(2):
        calls = chats.calls()
        rounds.append([request_body(strategy, c, r, names, cfg, "m") for c in calls])
        chats.answer({c.agent: "yes" for c in calls})
    return rounds


def test_plain_vllm_gets_what_a_framework_sends_and_nothing_of_kmesh():
    for body in bodies("vllm")[1]:
        assert "kmesh" not in body and body["cache_salt"] == "vllm:run-1"
        assert body["temperature"] == 0 and body["stream"]


def test_exact_declares_messages_and_a_family_without_recovery_under_an_exact_salt():
    for body in bodies("kmesh_exact")[1]:
        kmesh = body["kmesh"]
        assert "recovery" not in kmesh and not body["cache_salt"].startswith("kmesh-approx")
        assert len(kmesh["messages"]) == len(body["messages"])
        assert kmesh["family"] == "council:run-1" and kmesh["branches"] == 3 * 3


def test_collective_declares_the_round_from_round_one_under_an_approximate_salt():
    first, second = bodies("kmesh_collective")
    assert all("round" not in b["kmesh"]["recovery"] for b in first)
    for body in second:
        assert body["cache_salt"].startswith("kmesh-approx:kmesh_collective")
        assert body["kmesh"]["recovery"]["round"] == {
            "id": "r1",
            "segments": ["out-0-0", "out-0-1", "out-0-2"],
        }
    assert all(b["kmesh"]["keep_output"] for b in bodies("kmesh_per_request")[1])


def test_recovering_calls_declare_when_their_agent_comes_back_and_exact_ones_do_not():
    for strategy in ("kmesh_per_request", "kmesh_collective"):
        first, second = bodies(strategy)  # rounds 0 and 1 of 3
        assert {b["kmesh"]["next_use"] for b in first} == {1}
        assert {b["kmesh"]["next_use"] for b in second} == {2}
    assert all("next_use" not in b["kmesh"] for b in bodies("kmesh_exact")[1])
    cfg = AgentsBenchConfig(agents=(2,), rounds=2, engine="reference")
    call = AgentChats(cfg.chats(2), str.split).calls()[0]
    last = request_body(
        "kmesh_collective", call, 1, RunNames("kmesh_collective", "r", 2, 2), cfg, "m"
    )
    assert "next_use" not in last["kmesh"]  # no round after the last


def test_an_agent_count_holds_the_slo_only_with_every_smaller_one():
    def run(p99: float, failures: tuple = ()) -> dict:
        return {"ttft_p99_s": p99, "failures": list(failures)}

    assert _max_under_slo({"4": run(1), "8": run(2), "16": run(9)}, 5) == 8
    assert _max_under_slo({"4": run(6), "8": run(2)}, 5) == 0
    assert _max_under_slo({"4": run(1), "8": run(1, ("x: http 500",))}, 5) == 4


def fake_run(makespans: list[float], text: str = "yes") -> dict:
    """A strategy's run at 2 agents, as bench/agents/run.py records it, with these round
    makespans."""
    return {
        "rounds": [
            {
                "makespan_s": m,
                "ttft_s": [m / 2, m / 4],
                "counters": {"prompt": 10.0, "computed": 5.0},
                "new_tokens": 4,
                "kv_usage_end": 0.1,
                "kv_usage_peak": 0.2,
                "store_bytes": None,
                "failures": [],
                "texts": {"0": text, "1": "no"},
                "cpu_s": {"server": m, "total": m},
            }
            for m in makespans
        ]
    }


def test_several_passes_report_medians_of_each_pass_against_its_own_plain_vllm():
    cfg = AgentsBenchConfig(agents=(2,), rounds=2, engine="reference", repeats=3)
    passes = [
        {"vllm": {2: fake_run([5, 5])}, "kmesh_exact": {2: fake_run([4, 7])}},  # 11 / 10
        {"vllm": {2: fake_run([6, 6])}, "kmesh_exact": {2: fake_run([6, 6], "other")}},  # 12 / 12
        {"vllm": {2: fake_run([10, 10])}, "kmesh_exact": {2: fake_run([9, 9])}},  # 18 / 20
    ]
    exact = agents_report(cfg, passes)["strategies"]["kmesh_exact"]["by_agents"]["2"]
    assert exact["repeats"]["makespan_s"] == [11, 12, 18]
    assert exact["repeats"]["over_vllm"] == pytest.approx([1.1, 1.0, 0.9])
    assert exact["makespan_s"] == 12 and exact["over_vllm"] == pytest.approx(1.0)
    assert exact["repeats"]["identical_to_vllm"] == [[1.0, 1.0], [0.5, 0.5], [1.0, 1.0]]
    assert exact["round_makespan_s"] == [4, 7]  # every other figure is the first pass's
    assert exact["cpu_s_total"] == 12 and exact["ttft_p99_s"] == 3.5  # 3.5, 3, 4.5


TASK_FIELDS = (
    "task_items",
    "task_accuracy",
    "task_retention",
    "task_retention_ci",
    "task_agreement",
)


def tasks_report(workload: str) -> dict:
    """The report of a 2-agent, 2-round pass whose agent "0" writes round 0's record right
    under vllm and says "yes" under kmesh_exact; agent "1" says "no" under both."""
    [said, _] = task_facts(AgentsConfig("tasks", 2, rounds=2))
    record = " ".join(f"{NAMES[s.member]} proposes {s.number}." for s in said)
    cfg = AgentsBenchConfig(workload=workload, agents=(2,), rounds=2, engine="reference")
    runs = {"vllm": {2: fake_run([5, 5], record)}, "kmesh_exact": {2: fake_run([4, 4])}}
    return agents_report(cfg, [runs])


def test_the_tasks_workload_reports_task_accuracy_against_vllms_per_strategy():
    strategies = tasks_report("tasks")["strategies"]
    plain, exact = (strategies[s]["by_agents"]["2"] for s in ("vllm", "kmesh_exact"))
    assert plain["task_items"] == exact["task_items"] == 4  # round 1: 2 agents x 2 members
    assert (plain["task_accuracy"], plain["task_retention"], plain["task_agreement"]) == (
        0.5,
        1.0,
        1.0,
    )
    assert (exact["task_accuracy"], exact["task_retention"], exact["task_agreement"]) == (
        0.0,
        0.0,
        0.5,
    )


def test_other_workloads_report_no_task_figures():
    for figures in (s["by_agents"]["2"] for s in tasks_report("allgather")["strategies"].values()):
        assert not set(TASK_FIELDS) & set(figures)


def test_the_table_has_the_task_columns_for_the_tasks_workload_only():
    def printed(workload: str) -> str:
        console = Console(record=True, width=400)
        print_report(tasks_report(workload), console)
        return console.export_text()

    assert "task accuracy" in printed("tasks") and "0.50 of 4" in printed("tasks")
    assert "task accuracy" not in printed("allgather")


def test_both_vllm_servers_get_the_same_cache_and_dtype():
    cfg = AgentsBenchConfig(kv_cache="2G", dtype="bfloat16")
    options = kmesh_serve_options(cfg, "/s.sock")
    assert options == ("--store", "/s.sock", "--kv-cache", "2G", "--dtype", "bfloat16")
    assert build_parser().parse_args(["serve", "--engine", "vllm", *options]).dtype == "bfloat16"
    assert AgentsBenchConfig().dtype == "float32"  # where greedy outputs can be compared
    assert kmesh_serve_options(AgentsBenchConfig(engine="reference"), "/s") == ("--store", "/s")
    assert AgentsBenchConfig(engine="reference", dtype="bfloat16").computed_in == "float32"


@pytest.mark.model
def test_the_cache_holds_twice_the_pages_in_bfloat16():
    # 4 GiB of 32-token pages, 30 layers x 3 kv heads x 64 x K and V: 1,474,560 bytes in float32
    assert _kv_pages(AgentsBenchConfig()) == 2912
    assert _kv_pages(AgentsBenchConfig(dtype="bfloat16")) == 5825
    assert _kv_pages(AgentsBenchConfig(engine="reference")) is None


def test_a_bench_it_cannot_run_is_refused_with_what_to_change():
    with pytest.raises(InvalidRequestError, match="must include vllm"):
        AgentsBenchConfig(strategies=("kmesh_exact",))
    with pytest.raises(InvalidRequestError, match="--agents"):
        AgentsBenchConfig(agents=(1, 4))
    with pytest.raises(InvalidRequestError, match="--kv-cache"):
        AgentsBenchConfig(kv_cache="lots")
    with pytest.raises(InvalidRequestError, match="--repeats"):
        AgentsBenchConfig(repeats=0)
    with pytest.raises(InvalidRequestError, match="--dtype must be one of float32, bfloat16"):
        AgentsBenchConfig(dtype="float16")
    with pytest.raises(InvalidRequestError, match="--agents must be between 2 and 24"):
        AgentsBenchConfig(workload="tasks", agents=(4, 32))
    with pytest.raises(InvalidRequestError, match="--rounds must be at least 2"):
        AgentsBenchConfig(workload="tasks", rounds=1)


def test_the_plot_draws_makespan_and_ttft_per_strategy_with_the_slo(tmp_path):
    def run(makespans, p99s):
        return {
            "by_agents": {
                str(n): {"makespan_s": m, "ttft_p99_s": t}
                for n, m, t in zip((4, 12, 24), makespans, p99s, strict=True)
            }
        }

    result = {
        "config": {
            "workload": "allgather",
            "rounds": 3,
            "engine": "vllm",
            "dtype": "float32",
            "slo_ttft_s": 10.0,
        },
        "strategies": {
            "vllm": run([11, 38, 131], [1.6, 12, 56]),
            "c": run([10, 17, 44], [2, 3, 10]),
        },
    }
    path = tmp_path / "agents.png"
    plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
