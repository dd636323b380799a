"""The closed loop's plumbing: outputs feed the next round, the summary's arithmetic, and the
reference engine's driver on the tiny model (exact recovery gives full prefill's outputs)."""

from kmesh.bench.allgather.closed_loop import (
    Said,
    closed_loop_summary,
    computed_of,
    plain_loops,
    reference_closed_loop,
    run_closed_loop,
)
from kmesh.bench.allgather.config import STRATEGIES, AllGatherBenchConfig
from kmesh.workloads.allgather import AllGatherConfig

END = 2  # the tiny model's end of sequence, standing for <|im_end|>


class ByteTokenizer:
    """Characters as token ids in the tiny model's vocabulary (no model files needed)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % 250 for c in text]}

    def convert_tokens_to_ids(self, token: str) -> int:
        return END

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != END)


WORKLOAD = AllGatherConfig(agents=3, rounds=2, output_tokens=4)


def test_each_strategys_outputs_feed_its_own_next_round():
    seen: dict[str, list[int]] = {}

    def generate(name, r, turns):
        if r == 1:
            seen[name] = list(turns[0].prompt.token_ids)
        # "bad" answers differently from "good" in round 0 only.
        return [
            Said([10 + a + (name == "bad" and r == 0), END], r + 0.5) for a in range(len(turns))
        ]

    outputs = run_closed_loop(WORKLOAD, ByteTokenizer(), ["good", "bad"], generate)
    assert seen["good"] != seen["bad"]  # round 1 read each strategy's own round-0 outputs
    assert 10 in seen["good"] and 10 not in seen["bad"]
    summary = closed_loop_summary({"full": outputs["good"], "bad": outputs["bad"]})
    assert summary["full"]["identical_share_per_round"] == [1.0, 1.0]
    assert summary["bad"]["identical_share_per_round"] == [0.0, 1.0]
    assert summary["bad"]["common_prefix_mean_per_round"] == [0.0, 1.0]
    assert summary["bad"]["computed_tokens_per_round"] == [1.5, 4.5]  # 3 agents, 0.5 then 1.5


def said(*outputs: list[int]) -> list[Said]:
    return [Said(list(o), 1.0) for o in outputs]


def test_the_common_prefix_is_a_share_of_the_reference_output():
    outputs = {"full": [said([1, 2, 3, 4], [5, 6])], "x": [said([1, 2, 9, 9], [5, 6])]}
    summary = closed_loop_summary(outputs)["x"]
    assert summary["identical_share_per_round"] == [0.5]
    assert summary["common_prefix_mean_per_round"] == [0.75]  # (2/4 + 2/2) / 2


def test_exact_recovery_in_the_reference_engine_closes_the_loop_like_full_prefill(
    make_tiny_engine,
):
    cfg = AllGatherBenchConfig(policy="full", recompute_ratio=1.0, agent_ratio=1.0, gate=None)
    summary = reference_closed_loop(make_tiny_engine(), ByteTokenizer(), WORKLOAD, plain_loops(cfg))
    assert list(summary) == list(STRATEGIES)
    for name in STRATEGIES:
        assert summary[name]["identical_share_per_round"] == [1.0, 1.0], name
    # Every strategy computed something, and prefix reuse computed less than full prefill.
    assert all(sum(s["computed_tokens_per_round"]) > 0 for s in summary.values())
    full, prefix = (sum(summary[n]["computed_tokens_per_round"]) for n in ("full", "prefix"))
    assert prefix < full


def test_a_requests_computed_tokens_add_recoverys_own_and_the_master_it_built():
    assert computed_of(10, None) == 10
    assert computed_of(10, {"computed_tokens": 2.5, "shared_computed_tokens": 4.0}) == 16.5
    assert computed_of(3, {"refused": "no segments"}) == 3
