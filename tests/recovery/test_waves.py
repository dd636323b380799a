"""Per-request jobs of a step in waves (kmesh/recovery/waves.py), on stand-in jobs: which jobs
share an executor batch and which wait for the wave before them."""

from kmesh.recovery.jobs import RecoveryJob
from kmesh.recovery.waves import waves
from kmesh.state.recovery_meta import RecoverySpec

PAGE = 4
SPEC = RecoverySpec(policy="none", gate=None)


def job(name: str, blocks: list[int], start: int, end: int, spec=SPEC) -> RecoveryJob:
    return RecoveryJob(name, list(range(end + 1)), blocks, start, end, "t", [], spec, None)


def names(jobs, lacks=None, page_size=PAGE, max_rows=1000) -> list[list[str]]:
    lacks = lacks or {}
    lack = lambda j: set(lacks.get(j.request_id, ()))  # noqa: E731
    asked = waves(jobs, lack, lambda j: j.spec, page_size, max_rows)
    return [[j.request_id for j in wave] for wave in asked]


def test_jobs_that_need_nothing_from_each_other_share_one_wave():
    jobs = [job("a", [0, 1, 2], 4, 11), job("b", [0, 3, 4], 4, 11), job("c", [0, 5, 6], 4, 11)]
    assert names(jobs) == [["a", "b", "c"]]  # page 0 is everyone's prefix, filled by none


def test_a_job_lacking_what_an_earlier_job_lacks_waits_to_reuse_what_that_one_stores():
    jobs = [job("a", [0, 1, 2], 4, 11), job("b", [0, 3, 4], 4, 11), job("c", [0, 5, 6], 4, 11)]
    lacks = {"a": [(7, 8)], "b": [(7, 8)], "c": [(9,)]}
    assert names(jobs, lacks) == [["a", "c"], ["b"]]


def test_a_job_whose_prefix_lies_in_a_page_an_earlier_job_fills_waits_for_it():
    jobs = [job("a", [0, 1, 2], 4, 11), job("b", [0, 1, 2, 3], 12, 15)]  # b's prefix: a's pages
    assert names(jobs) == [["a"], ["b"]]


def test_a_job_waits_behind_a_waiting_job_it_depends_on():
    jobs = [job("a", [0, 1], 0, 7), job("b", [0, 2], 0, 7), job("c", [0, 2, 3], 8, 11)]
    lacks = {"a": [(5,)], "b": [(5,)]}  # b waits for a; c reads b's page 2
    assert names(jobs, lacks) == [["a"], ["b"], ["c"]]


def test_a_job_with_other_recovery_settings_is_batched_apart():
    full = RecoverySpec(policy="full")
    jobs = [job("a", [0, 1], 4, 7), job("b", [0, 2], 4, 7, full), job("c", [0, 3], 4, 7)]
    assert names(jobs) == [["a", "c"], ["b"]]


def test_a_wave_holds_at_most_its_rows_but_a_larger_job_goes_alone():
    jobs = [job("a", [0, 1, 2], 4, 11), job("b", [0, 3, 4], 4, 11), job("c", [0, 5, 6], 4, 11)]
    assert names(jobs, max_rows=16) == [["a", "b"], ["c"]]
    assert names(jobs, max_rows=4) == [["a"], ["b"], ["c"]]


def test_without_a_page_size_every_job_is_a_wave_of_its_own():
    jobs = [job("a", [0, 1], 4, 7), job("b", [0, 2], 4, 7)]
    assert names(jobs, page_size=None) == [["a"], ["b"]]


def test_what_a_job_lacks_is_asked_once_the_wave_before_it_ran():
    jobs = [job("a", [0, 1], 4, 7), job("b", [0, 2], 4, 7), job("c", [0, 3], 4, 7)]
    stored: set[tuple[int, ...]] = set()
    segment = (5, 6)

    def lacking(j: RecoveryJob) -> set[tuple[int, ...]]:
        return set() if segment in stored else {segment}

    got = []
    for wave in waves(jobs, lacking, lambda j: j.spec, PAGE, 1000):
        got.append([j.request_id for j in wave])
        stored.add(segment)  # the wave's first reader stored it
    assert got == [["a"], ["b", "c"]]
