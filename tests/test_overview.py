import numpy as np

from workbench.cases.overview import padding_demo, plot_padding_demo


def test_padded_rows_keep_values_from_earlier_steps():
    demo = padding_demo([4, 3, 1], capture_sizes=[2, 4])
    assert demo.padded_sizes == [4, 4, 2]
    assert demo.buffer[:, 1].tolist() == [2, 2, 2, 1]      # slot 3 still holds step 1's value
    assert demo.stale_slots == [[], [3], [1]]
    assert demo.buffer[1, 2] == 2                          # step 3 ran 1 row padded to 2
    fig = plot_padding_demo(demo)
    assert fig.axes and np.isfinite(demo.buffer).all()


def test_matrix_figure_has_a_cell_per_architecture_and_backend():
    from workbench.cases.overview import plot_matrix
    from workbench.hf_matrix import ENTRIES
    cpu = {e.label: {"captured": True, "error_kind": None, "max_abs_diff": 0.0} for e in ENTRIES}
    cpu[ENTRIES[0].label] = {"captured": False, "error_kind": "host_sync", "max_abs_diff": None}
    fig = plot_matrix(cpu, {}, ENTRIES)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(texts) == 2 * len(ENTRIES)
    assert texts.count("not recorded") == len(ENTRIES) and "failed: host_sync" in texts
