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
