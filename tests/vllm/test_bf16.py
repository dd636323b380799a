"""Recovery inside real vLLM 0.32 on CPU in bfloat16 (the embedded model), against vanilla vLLM in
bfloat16, with every tolerance measured in the same run. The engines run in one child process
(bf16_job.py).

In bfloat16 no two ways of computing a prompt agree bit for bit, not even vLLM's own: a cold
prefill, one after a prefix hit and one in another batch run its kernels on other shapes, and how
far they round apart depends on the CPU's kernels (AVX-512 BF16 and AMX tiles reduce in other
orders). So no constant is carried from one machine: the job computes each prompt the ways vLLM
itself does (alone, and after a prefix hit of half the trunk)
and this module measures, against vanilla's cold batch:
- vLLM's own spread: the largest logprob difference of a greedy token over the steps before a
  variant's first differing token, over every prompt and variant (the kernels' rounding, not a
  prompt's), and per prompt the steps on which every variant still agrees with the cold run
  (`stable`: past them vLLM's own greedy path is not decided by vLLM).
- KMesh's: the same difference for policy `full` (KMesh's executor computes every row before the
  last token) and for `full` after a local prefix hit.

KMesh is bounded by vLLM: within the stable steps, its logprob drift is within twice the spread
(two computations each within the spread of one value are within twice it of each other); its
greedy tokens are vanilla's, or differ first at a step where vanilla's margin over the runner-up
is within four times the spread (the margin is the difference of two logits, each of which moves
by up to twice the spread between the two computations: a near-tie rounding decides either way).
A machine's figures are in docs/guide/exactness.md.
Wrong KV (rows, positions, layout, dtype) moves logprobs by nats and flips tokens at wide
margins. The figures are stated in pytest's summary (tests/conftest.py, `stated`). A premise
about vLLM that does not hold here (its own ways bit-identical, or apart from the first token) is
stated with its figures, and the checks that need it say so instead of failing KMesh.
"""

from dataclasses import dataclass

import pytest

from tests.vllm.bf16_job import CHECKED, HIT, TRUNK_TOKENS

pytestmark = [pytest.mark.model, pytest.mark.vllm]

JOB = "bf16_job.py"


@pytest.fixture(scope="module")
def result(job_result) -> dict:
    return job_result


def agreed(got: dict, want: dict) -> int:
    """Greedy steps before the first whose token differs (all of them if none does)."""
    for step, (a, b) in enumerate(zip(got["ids"], want["ids"], strict=True)):
        if a != b:
            return step
    return len(want["ids"])


def drift(got: dict, want: dict, steps: int) -> float:
    """The largest logprob difference of the greedy tokens over the first `steps` steps."""
    pairs = list(zip(got["logprobs"], want["logprobs"], strict=True))[:steps]
    return max((abs(a - b) for a, b in pairs), default=0.0)


@dataclass(frozen=True)
class Spread:
    """vLLM's own bfloat16 spread (module docstring)."""

    drift: float  # nats: the largest over every prompt's variants, over their agreed steps
    stable: int  # steps every variant of this prompt agrees with its cold run on

    @property
    def bound(self) -> float:
        """KMesh's logprob drift at most."""
        return 2 * self.drift

    @property
    def near_tie(self) -> float:
        """A margin at which KMesh may take the runner-up."""
        return 4 * self.drift


def spread(result: dict, name: str) -> Spread:
    drifts, stable = [], len(result["vanilla"][name]["ids"])
    for prompt in CHECKED:
        cold = result["vanilla"][prompt]
        for runs in result["vanilla_variants"].values():
            steps = agreed(runs[prompt], cold)
            drifts.append(drift(runs[prompt], cold, steps))
            if prompt == name:
                stable = min(stable, steps)
    return Spread(max(drifts), stable)


def check_bounded(got: dict, name: str, result: dict, stated) -> None:
    """KMesh's run `got` of prompt `name` within vLLM's own spread (module docstring)."""
    cold, own = result["vanilla"][name], spread(result, name)
    steps = min(agreed(got, cold), own.stable)
    mine = drift(got, cold, steps)
    stated(
        f"bf16 {name}: vLLM's own spread {own.drift:.3f} nats (this prompt stable for "
        f"{own.stable} of {len(cold['ids'])} steps); KMesh's drift {mine:.3f} nats (bound "
        f"{own.bound:.3f}), {agreed(got, cold)} steps identical"
    )
    if own.drift == 0:
        stated(
            f"bf16 {name}: premise not met here: vLLM's own ways are bit-identical, so KMesh's "
            "tokens are held to vanilla's with no near-tie allowance and its drift is not bounded"
        )
    if own.stable == 0:
        stated(
            f"bf16 {name}: premise not met here: vLLM's own ways differ from the first token, so "
            "no step of KMesh's greedy path is decided by vLLM: nothing compared"
        )
    if steps < own.stable:  # KMesh flipped where vLLM's own ways agree: only at a near-tie
        margin = cold["margins"][steps]
        stated(f"bf16 {name}: KMesh takes the runner-up at step {steps} (margin {margin:.3f})")
        assert margin <= own.near_tie, (name, steps, margin, own)
    if own.drift > 0:
        assert mine <= own.bound, (name, mine, own)


def test_policy_full_in_bfloat16_stays_within_vllms_own_spread(result, stated):
    for name in CHECKED:
        check_bounded(result["full"][name], name, result, stated)


def test_recovery_after_a_local_hit_reads_the_exact_prefix_back_from_bfloat16_pages(result, stated):
    got = result["full_after_local_hit"]
    half = TRUNK_TOKENS // 2
    assert got["reused_tokens"] == half  # vLLM's prefix cache: read back by the executor
    assert got["recovery"]["computed_tokens"] == got["recovered_tokens"] >= half
    check_bounded(got, HIT, result, stated)


def test_recovery_really_ran_in_bfloat16(result):
    """Every full block before the last token claimed and filled by KMesh's executor: nothing
    refused, nothing given back to vLLM."""
    for name in CHECKED:
        got = result["full"][name]
        assert "refused" not in got["recovery"] and not got["recovery"]["fell_back"], name
        assert got["recovered_tokens"] >= TRUNK_TOKENS, name
        assert got["recovery"]["computed_tokens"] == got["recovered_tokens"] > 0, name
        assert got["computed_tokens"] == got["prompt_tokens"] - got["recovered_tokens"], name


def test_vllms_own_variants_ran_the_ways_they_name(result):
    """The spread is measured on real variants: each computed every prompt and decoded the
    same number of tokens as the cold run."""
    assert set(result["vanilla_variants"]) == {"alone", "after_hit"}
    for runs in result["vanilla_variants"].values():
        for name in CHECKED:
            assert len(runs[name]["ids"]) == len(result["vanilla"][name]["ids"]), name
