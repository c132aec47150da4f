"""A progress bar stopped by an expected crash says so, and is not left looking like a failure."""
import io

from tqdm import tqdm
from tqdm.notebook import tqdm as notebook_tqdm

from workbench.expect import label_predicted_crash


def test_console_bar_is_labelled_and_complete():
    out = io.StringIO()
    bar = tqdm(range(1, 11), desc="bug", file=out, leave=False)
    for request in bar:
        if request == 7:
            label_predicted_crash(bar, request)
            break
    last = out.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("crashed as predicted at request 7: 100%") and "6/6" in last


def test_notebook_bar_ends_green_not_red():
    bar = notebook_tqdm(total=10, desc="bug", leave=False)
    bar.update(6)
    label_predicted_crash(bar, 7)
    label, progress, _ = bar.container.children
    assert progress.bar_style == "success" and progress.value == progress.max == 6
    assert label.value.replace("\u2007", " ").startswith("crashed as predicted at request 7")   # figure spaces
