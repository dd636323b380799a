"""Quality targets: their validation, and how each resolves to a calibrated setting or to exact
service, saying which."""

import pytest
from pydantic import ValidationError

from kmesh.recovery.quality import GREEDY_SHARE, Calibration, resolve_quality
from kmesh.state.recovery_meta import RecoverySpec, RoundSpec

MODEL = "m" * 64
ROUND = RoundSpec(id="r1", segments=["a"])


def calibration(label: str, **fields) -> Calibration:
    given = {
        "model": MODEL,
        "kind": "round",
        "label": label,
        "ratio": 0.3,
        "master": "sibling",
        "gate": 0.1,
        "kl_p95": 0.05,
        "identical_min": 0.5,
        "tokens_over_prefix": 0.5,
        **fields,
    }
    return Calibration(**given)


def test_a_target_is_exact_greedy_or_a_kl_bound_and_replaces_the_knobs():
    for target in ("exact", "greedy", "kl:0.05", "kl:1e-3", "kl:.2"):
        assert RecoverySpec(quality=target).quality == target
    with pytest.raises(ValidationError, match="'exact', 'greedy' or 'kl:<x>'"):
        RecoverySpec(quality="kl:")
    with pytest.raises(ValidationError, match="replaces \\['ratio'\\]"):
        RecoverySpec(quality="greedy", ratio=0.5)
    assert not RecoverySpec(quality="exact", round=ROUND).approximate
    assert RecoverySpec(quality="greedy").approximate


def test_a_spec_without_a_target_is_served_as_it_is():
    spec = RecoverySpec(policy="kv_deviation", ratio=0.2)
    assert resolve_quality(spec, MODEL) == (spec, None)


def test_exact_is_served_without_recovery():
    assert resolve_quality(RecoverySpec(quality="exact", round=ROUND), MODEL) == (
        None,
        {"target": "exact", "served": "exact"},
    )


def test_a_target_no_calibration_meets_is_served_exactly_and_says_why():
    spec = RecoverySpec(quality="greedy", round=ROUND)
    loose = calibration("loose", identical_min=GREEDY_SHARE - 0.01)
    got, note = resolve_quality(spec, MODEL, [loose])
    assert got is None and note is not None
    assert note["served"] == "exact" and "'greedy'" in note["reason"] and "round" in note["reason"]
    # Another model's calibrations, or another kind's, never serve this one.
    good = calibration("good", identical_min=1.0)
    assert resolve_quality(spec, "x" * 64, [good])[0] is None
    assert resolve_quality(RecoverySpec(quality="greedy"), MODEL, [good])[0] is None


def test_the_cheapest_setting_that_meets_the_target_serves_it():
    settings = [
        calibration("dear", ratio=0.5, master="common", kl_p95=0.01, tokens_over_prefix=0.8),
        calibration(
            "cheap", ratio=0.1, master="common", gate=0.01, kl_p95=0.04, tokens_over_prefix=0.4
        ),
        calibration("too loose", ratio=0.0, kl_p95=0.2, tokens_over_prefix=0.2),
        calibration("dearer than prefix", ratio=0.9, kl_p95=0.0, tokens_over_prefix=1.1),
    ]
    spec = RecoverySpec(quality="kl:0.05", round=ROUND)
    got, note = resolve_quality(spec, MODEL, settings)
    assert note == {"target": "kl:0.05", "served": "cheap"}
    assert got is not None and got.quality is None and got.approximate
    assert (got.policy, got.ratio, got.gate, got.round.master) == (
        "kv_deviation",
        0.1,
        0.01,
        "common",
    )
    got, note = resolve_quality(RecoverySpec(quality="kl:0.001", round=ROUND), MODEL, settings)
    assert got is None and note["served"] == "exact"  # only dearer than prefix caching meets it


@pytest.mark.model
def test_the_shipped_calibrations_are_the_embedded_models_and_each_is_cheaper_than_prefix():
    from kmesh.compute.fingerprint import model_fingerprint
    from kmesh.compute.loader import resolve_model_dir
    from kmesh.recovery.quality import CALIBRATIONS, EMBEDDED

    assert model_fingerprint(resolve_model_dir(None)) == EMBEDDED  # a new model needs new rows
    assert len({c.label for c in CALIBRATIONS}) == len(CALIBRATIONS)
    for c in CALIBRATIONS:
        assert c.kind in ("round", "request") and 0 < c.tokens_over_prefix < 1, c.label
        assert (c.master is not None) == (c.kind == "round"), c.label
    # On it, greedy is served exactly and a KL bound by the cheapest setting within it.
    spec = RecoverySpec(quality="greedy", round=ROUND)
    assert resolve_quality(spec, EMBEDDED)[0] is None
    got, note = resolve_quality(RecoverySpec(quality="kl:0.05", round=ROUND), EMBEDDED)
    assert got is not None and note["served"] == "collective agent_ratio=0.3 sibling"
