"""Statistics of `kmesh bench tasks`: each reuse strategy against full prefill on the same items.

Answers are paired (full prefill and a strategy score the same items), so the comparisons here are
paired too: a bootstrap interval of the retention (strategy accuracy over full accuracy) that
resamples items, McNemar's exact test on the items only one of the two got right, and, at the
answer's position, a KL divergence between next-token distributions known only by their top
tokens, with agreement split by how decided full prefill was (its margin). Pure functions, no
engine.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Mass below this is treated as this much in coarse_kl's "every other token" bucket: a remainder
# of 0 on the reference side only (or rounding below 0) would otherwise make the divergence
# infinite or undefined.
REST_EPSILON = 1e-12
# A log probability above this is not one (logits passed by mistake); up to it is rounding.
LOGPROB_SLACK = 1e-4

# Bins of full prefill's margin at the answer, in report order. A 0.5-nat gap between the top two
# tokens is an odds ratio of ~1.65: an answer a small perturbation of the KV can flip. 2 nats is
# ~7.4x: a confident answer, which a faithful strategy should keep.
MARGIN_BINS = ("low", "mid", "high", "unknown")
MARGIN_EDGES = (0.5, 2.0)  # low < 0.5 <= mid < 2.0 <= high


def _paired(full: Sequence[bool], other: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    if len(full) != len(other):
        raise ValueError(
            f"full prefill and the strategy must score the same items, got {len(full)} and "
            f"{len(other)} answers"
        )
    return np.asarray(full, dtype=bool), np.asarray(other, dtype=bool)


def retention(full: Sequence[bool], other: Sequence[bool]) -> float | None:
    """Retention of a strategy: its number of correct answers over full prefill's.

    The same items in the same order (ValueError if the lengths differ). None when full prefill
    got nothing right (or there are no items). Above 1 when the strategy got more right.
    """
    full_ok, other_ok = _paired(full, other)
    num_full = int(full_ok.sum())
    if num_full == 0:
        return None
    return int(other_ok.sum()) / num_full


def retention_interval(
    full: Sequence[bool],
    other: Sequence[bool],
    *,
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Paired bootstrap percentile interval of retention (see `retention`).

    Each resample draws n item indices with replacement, the same for both lists, and takes
    sum(other) / sum(full) over them; resamples in which full prefill got nothing right are
    dropped. The interval is the (1 - level) / 2 and (1 + level) / 2 quantiles of those ratios
    (numpy's linear interpolation). None when full prefill never got an item right, there are no
    items, or every resample was dropped. Deterministic in seed: one [resamples, n] draw from
    numpy's default Generator.
    """
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    full_ok, other_ok = _paired(full, other)
    n = len(full_ok)
    if not full_ok.any():
        return None
    rng = np.random.default_rng(seed)
    items = rng.integers(0, n, size=(resamples, n), dtype=np.int32)
    num_full = full_ok[items].sum(axis=1)
    num_other = other_ok[items].sum(axis=1)
    kept = num_full > 0
    if not kept.any():
        return None
    ratios = num_other[kept] / num_full[kept]
    low, high = np.quantile(ratios, [(1.0 - level) / 2, (1.0 + level) / 2])
    return float(low), float(high)


@dataclass(frozen=True, slots=True)
class McNemar:
    """McNemar's exact test of two paired scorings: only the discordant items count."""

    only_full: int  # items full prefill got right and the strategy wrong
    only_other: int  # items the strategy got right and full prefill wrong
    p_value: float  # two-sided, exact binomial


def mcnemar(full: Sequence[bool], other: Sequence[bool]) -> McNemar:
    """Exact two-sided McNemar test of full prefill against a strategy on the same items.

    With b = only_full and c = only_other, p = min(1, 2 * P[X <= min(b, c)]) for
    X ~ Binomial(b + c, 1/2): how unlikely so lopsided a split of the discordant items is if
    neither side is better. p = 1 when no item is discordant. ValueError if the lengths differ.
    """
    full_ok, other_ok = _paired(full, other)
    only_full = int((full_ok & ~other_ok).sum())
    only_other = int((other_ok & ~full_ok).sum())
    num_discordant = only_full + only_other
    # NOTE: exact integers, then one correctly rounded division (Python's int / int), so the
    # tail neither overflows nor loses precision for thousands of discordant items.
    tail, term = 0, 1  # term = comb(num_discordant, k)
    for k in range(min(only_full, only_other) + 1):
        tail += term
        term = term * (num_discordant - k) // (k + 1)
    p_value = min(1.0, 2 * tail / 2**num_discordant)
    return McNemar(only_full=only_full, only_other=only_other, p_value=p_value)


def _check_logprobs(logprobs: Mapping[int, float], name: str) -> None:
    too_high = [token for token, lp in logprobs.items() if lp > LOGPROB_SLACK]
    if too_high:
        raise ValueError(
            f"{name} holds log probabilities above 0 (token {too_high[0]}: "
            f"{logprobs[too_high[0]]}); pass log_softmax values, not logits"
        )


def coarse_kl(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """KL(P || Q) in nats between two next-token distributions known only in part.

    p and q map some token ids to natural-log probabilities (an engine's top-k plus the sampled
    token, say). The vocabulary is coarse-grained into the tokens both maps know, each a bucket
    of its own, and one bucket for every other token, whose mass on each side is 1 minus that
    side's mass on the shared tokens (at least REST_EPSILON, so a shared mass that rounds above
    1 leaves a remainder of ~0). A token only one map knows falls in the remainder bucket.

    By the data-processing inequality the result is a lower bound of the true KL, and it equals
    the true KL when both maps hold the whole vocabulary. Maps that share no token give 0 (the
    bound says nothing). Clamped at >= 0 (tiny negative rounding). ValueError if a value is
    clearly not a log probability (above 0 by more than LOGPROB_SLACK).
    """
    _check_logprobs(p, "p")
    _check_logprobs(q, "q")
    shared = p.keys() & q.keys()
    p_rest = max(1.0 - math.fsum(math.exp(p[token]) for token in shared), REST_EPSILON)
    q_rest = max(1.0 - math.fsum(math.exp(q[token]) for token in shared), REST_EPSILON)
    # A token with p = 0 (log -inf) adds nothing, whatever q says.
    terms = [math.exp(p[token]) * (p[token] - q[token]) for token in shared if p[token] > -math.inf]
    kl = math.fsum(terms) + p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def margin(logprobs: Mapping[int, float]) -> float:
    """Gap in nats between the most and the second most likely known tokens.

    inf when only one token is known; ValueError when none is.
    """
    if not logprobs:
        raise ValueError("no token's log probability is known, so there is no margin")
    if len(logprobs) == 1:
        return math.inf
    first, second = sorted(logprobs.values(), reverse=True)[:2]
    return first - second


def margin_bin(m: float | None) -> str:
    """The MARGIN_BINS name of a margin: low (< 0.5 nats), mid (< 2), high, unknown for None."""
    if m is None:
        return "unknown"
    if not m >= 0.0:
        raise ValueError(f"a margin is a gap >= 0 nats, got {m}")
    low_edge, high_edge = MARGIN_EDGES
    if m < low_edge:
        return "low"
    if m < high_edge:
        return "mid"
    return "high"


def agreement_by_margin(
    agree: Sequence[bool], margins: Sequence[float | None]
) -> dict[str, dict[str, float]]:
    """Share of items on which a strategy agrees with full prefill, by full prefill's margin.

    agree[i] says whether item i's answers agree; margins[i] is full prefill's margin there (None
    if unknown). Returns {bin: {"items": count, "agreement": share}} for the MARGIN_BINS that
    hold items, in that order, then "all". ValueError if the lengths differ or there are no
    items.
    """
    if len(agree) != len(margins):
        raise ValueError(f"got {len(agree)} agreements for {len(margins)} margins")
    if not agree:
        raise ValueError("no items to split by margin")
    counts = {name: [0, 0] for name in MARGIN_BINS}  # [items, agreeing]
    for agrees, m in zip(agree, margins, strict=True):
        count = counts[margin_bin(m)]
        count[0] += 1
        count[1] += int(agrees)
    by_bin: dict[str, dict[str, float]] = {
        name: {"items": items, "agreement": agreeing / items}
        for name, (items, agreeing) in counts.items()
        if items
    }
    by_bin["all"] = {"items": len(agree), "agreement": sum(map(bool, agree)) / len(agree)}
    return by_bin
