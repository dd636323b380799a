"""The response models describe the dicts the engines build: same field names, valid values."""

from dataclasses import asdict, fields

from kmesh.recovery.jobs import RecoveryReport
from kmesh.recovery.quality import resolve_quality
from kmesh.serve.reference_backend import STAT_NAMES
from kmesh.state.recovery_meta import RecoverySpec
from kmesh.state.response_meta import (
    ActivationStats,
    KMeshStats,
    QualityStats,
    RecoveryStats,
)
from kmesh.vllm.activated import Activation


def test_recovery_stats_are_a_recovery_report_or_a_refusal():
    names = {f.name for f in fields(RecoveryReport)}
    assert set(RecoveryStats.model_fields) == names | {"refused"}
    report = RecoveryReport(2.5, 0.0, 0, 0, 10, 0.02, False)
    RecoveryStats.model_validate(asdict(report))
    RecoveryStats.model_validate({"refused": "approximate recovery needs a cache_salt"})


def test_activation_stats_are_an_activation():
    assert set(ActivationStats.model_fields) == {f.name for f in fields(Activation)}
    ActivationStats.model_validate(asdict(Activation(12, "a note")))


def test_quality_stats_validate_what_resolving_a_target_reports():
    for target in ("exact", "greedy", "kl:0.05"):
        _, note = resolve_quality(RecoverySpec(quality=target), "some model fingerprint")
        QualityStats.model_validate(note)


def test_the_token_counts_are_the_reference_engines_stat_names():
    required = {name for name, info in KMeshStats.model_fields.items() if info.is_required()}
    assert required == set(STAT_NAMES)


def test_a_response_object_validates():
    KMeshStats.model_validate(
        {
            **dict.fromkeys(STAT_NAMES, 0),
            "recovery": {"refused": "why"},
            "quality": {"target": "exact", "served": "exact"},
            "family": "f1",
            "engine": "vllm",
            "branches": 2,
        }
    )
