"""bench/process_tree.py on this test's own process and a child of it."""

import os
import subprocess
import sys

from kmesh.bench.process_tree import cpu_seconds, cpu_used, rss_mib


def test_cpu_time_is_read_per_process_of_the_tree_and_differenced():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = cpu_seconds({"me": os.getpid()})
        sum(i * i for i in range(3_000_000))  # CPU time of this process only
        after = cpu_seconds({"me": os.getpid()})
        used = cpu_used(before, after)
        children = [name for name in after if name.startswith("me/")]
        assert children and all(used[name] < 0.05 for name in children)
        assert used["me"] > 0.05
        assert used["total"] == sum(v for k, v in used.items() if k != "total")
        assert f"{child.pid}" in " ".join(rss_mib(os.getpid()))
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_reads_as_nothing():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert cpu_seconds({"gone": child.pid}) == {}
