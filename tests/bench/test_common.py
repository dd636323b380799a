"""What every bench shares (kmesh/bench/common.py): the agents axis of its plots."""

from matplotlib.figure import Figure

from kmesh.bench.common import agents_axis


def test_the_agents_axis_labels_every_count_run_and_only_those():
    axes = Figure().subplots()
    axes.plot([4, 8, 12, 24], [1, 2, 3, 4])
    agents_axis(axes, [24, 4, 12, 8, 12])
    assert axes.get_xscale() == "log"
    assert list(axes.get_xticks()) == [4, 8, 12, 24]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["4", "8", "12", "24"]
    assert axes.get_xlabel() == "agents"
