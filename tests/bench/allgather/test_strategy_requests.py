"""The requests the All-Gather bench's strategies send: what each declares."""

from kmesh.bench.allgather.config import AllGatherBenchConfig
from kmesh.bench.allgather.strategy_requests import strategy_request
from kmesh.state.request_meta import KMeshParams
from kmesh.state.segments import Role, Segment, SegmentedPrompt
from kmesh.workloads.allgather import AgentTurn, output_segment_id

AGENTS = 4


def turn(r: int, agent: int) -> AgentTurn:
    segments = [Segment((1, 2, 3), Role.SHARED, "task")]
    segments += [
        Segment((10 + a,), Role.SHARED, output_segment_id(r - 1, a)) for a in range(AGENTS)
    ]
    segments.append(Segment((9,), Role.INSTRUCTION))
    return AgentTurn(r, agent, SegmentedPrompt.of(segments if r else segments[:1]), (), "")


def test_collective_members_declare_their_family_and_their_place_in_the_next_round():
    cfg = AllGatherBenchConfig()
    for r in (0, 1, 2):
        for agent in (0, 3):
            salt, kmesh = strategy_request("collective", r, turn(r, agent), cfg, AGENTS)
            assert salt is not None and salt.startswith("kmesh-approx")
            params = KMeshParams.model_validate(kmesh)  # the engines accept it
            assert params.family is not None
            assert params.next_use == (r + 1) * AGENTS + agent
            assert (params.recovery is not None and params.recovery.round is not None) == (r > 0)


def test_the_other_strategies_declare_no_next_use():
    cfg = AllGatherBenchConfig()
    for name in ("full", "prefix", "per_request"):
        _, kmesh = strategy_request(name, 1, turn(1, 2), cfg, AGENTS)
        assert "next_use" not in (kmesh or {}), name


def test_a_quality_target_is_sent_in_place_of_the_knobs():
    cfg = AllGatherBenchConfig(quality="greedy", recompute_ratio=0.7)
    for name in ("per_request", "collective"):
        _, kmesh = strategy_request(name, 1, turn(1, 2), cfg, AGENTS)
        recovery = KMeshParams.model_validate(kmesh).recovery
        assert recovery is not None and recovery.quality == "greedy"
        assert not {"policy", "ratio", "gate"} & set(kmesh["recovery"]), name
    _, plain = strategy_request("per_request", 1, turn(1, 2), AllGatherBenchConfig(), AGENTS)
    assert plain["recovery"]["ratio"] == 0.3 and "quality" not in plain["recovery"]


def test_the_check_layer_is_sent_only_when_given_else_the_engine_s_model_decides():
    for cfg, sent in ((AllGatherBenchConfig(), None), (AllGatherBenchConfig(check_layer=3), 3)):
        _, kmesh = strategy_request("per_request", 1, turn(1, 2), cfg, AGENTS)
        assert kmesh["recovery"].get("check_layer") == sent
        recovery = KMeshParams.model_validate(kmesh).recovery
        assert recovery is not None and recovery.check_layer == sent
