"""The closed loop's plumbing: outputs feed the next round, the summary's arithmetic, and the
reference engine's driver on the tiny model (exact recovery gives full prefill's outputs)."""

from kmesh.bench.allgather_config import STRATEGIES, AllGatherBenchConfig
from kmesh.bench.closed_loop import closed_loop_summary, reference_closed_loop, run_closed_loop
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
        return [[10 + a + (name == "bad" and r == 0), END] for a in range(len(turns))]

    outputs = run_closed_loop(WORKLOAD, ByteTokenizer(), ["good", "bad"], generate)
    assert seen["good"] != seen["bad"]  # round 1 read each strategy's own round-0 outputs
    assert 10 in seen["good"] and 10 not in seen["bad"]
    summary = closed_loop_summary({"full": outputs["good"], "bad": outputs["bad"]})
    assert summary["full"]["identical_share_per_round"] == [1.0, 1.0]
    assert summary["bad"]["identical_share_per_round"] == [0.0, 1.0]
    assert summary["bad"]["common_prefix_mean_per_round"] == [0.0, 1.0]


def test_the_common_prefix_is_a_share_of_the_reference_output():
    outputs = {"full": [[[1, 2, 3, 4], [5, 6]]], "x": [[[1, 2, 9, 9], [5, 6]]]}
    summary = closed_loop_summary(outputs)["x"]
    assert summary["identical_share_per_round"] == [0.5]
    assert summary["common_prefix_mean_per_round"] == [0.75]  # (2/4 + 2/2) / 2


def test_exact_recovery_in_the_reference_engine_closes_the_loop_like_full_prefill(
    make_tiny_engine,
):
    cfg = AllGatherBenchConfig(policy="full", recompute_ratio=1.0, agent_ratio=1.0, gate=None)
    summary = reference_closed_loop(make_tiny_engine(), ByteTokenizer(), WORKLOAD, cfg)
    assert list(summary) == list(STRATEGIES)
    for name in STRATEGIES:
        assert summary[name]["identical_share_per_round"] == [1.0, 1.0], name
