"""The plain-language root cause of each padded-row finding (``stale-padding``,
``padded-shape-mismatch``), filled in with what was observed: what padded rows are, which of
their values reach real rows, and which value a padded row needs instead."""
from __future__ import annotations


def stale_padding(first_input: str | None) -> str:
    via = (f" The first graph input whose real rows differ between the two runs is `{first_input}`: values "
           "derived from padded rows decided what real rows read." if first_input else "")
    return ("Real-row results depend on what padded rows hold: two otherwise identical runs, with the padded "
            f"rows filled two different ways, gave different results for real rows.{via}")


def padding_left() -> str:
    return ("Real-row results depend on what padded rows hold: as the runner left them (an earlier step's data) "
            "they gave real rows other results than the run without graphs, and with 0 or 1 there the same "
            "workload gives the same results as that run. Something over the whole padded batch (a reduction, a "
            "batch-wide scale, a sort) reads the padded rows: give them a neutral value before the replay, or keep "
            "them out of it.")


def padding_written(name: str, completes: bool) -> str:
    what = ("Whether the step completes" if completes else "What real rows get")
    other = ("with 0 there instead the same workload completes" if completes else
             "with 0 and with 1 there instead real rows get different results")
    return (f"{what} depends on what the padded rows of `{name}` hold: the runner writes them itself before the "
            f"replay, and {other}. A padded row still runs every kernel of the graph, so the value the runner gives "
            "it must be inert for each of them (a null block or slot that no real row reads or shares, not a "
            "sentinel only some kernels skip).")


def sentinel_index(op: str, value: int) -> str:
    return (f"Fixed shapes (what a CUDA graph replays) pad a variable number of items -- neighbour pairs, tokens, "
            f"slots -- with a sentinel ({value}) that means 'no item'. {op} takes it as an index: on the CPU it "
            "raises, on a GPU a device-side assert or a write before the table's start. Mask the padded entries "
            "before they index anything: point them at a dummy row whose result is dropped (and zero their "
            "weights), or filter them with a mask the kernel honours.")


def padded_index() -> str:
    return ("The graph computes an index from each row's metadata, and the values the runner leaves in padded rows "
            "(a zero length under a query of one token, a slot of -1) give an index outside the table it looks up: "
            "on a GPU an illegal memory access or a silent read of other memory, in every padded step. Give padded "
            "rows metadata that is valid for every kernel that reads it (a length at least the query's, a reserved "
            "valid slot), not only neutral for the real rows' results.")


def dummy_index(buffer: str, state: bool) -> str:
    if state:
        return (f"The dummy rows of a warmup or capture index through {buffer} at entries no request wrote (a "
                "dummy request's row, left as allocated), and the index found there runs past the table it looks "
                "up: on a GPU an illegal memory access at startup, or a silent read of other memory. Initialise "
                f"the entries dummy and padded rows read ({buffer} zeroed, a reserved valid slot), or point those "
                "rows at entries that hold valid indices.")
    return (f"The runner's dummy batch puts an index into {buffer} that runs past the end of the table it looks up "
            "(a position past the rotary cache, a slot past the pool): the dummy data does not fit what the graph "
            "indexes. Bound the dummy batch by every table its indices reach, or size the table for the largest "
            "index a capture can carry.")


def nonfinite_padding(op: str) -> str:
    return (f"Padded rows computed NaN or infinity (a row with no keys to attend to, memory no kernel wrote), and "
            f"{op} mixes rows, so it hands them to every real row: a per-tensor scale from the whole padded batch, a "
            "reduction over all tokens. Give padded rows values that stay finite (a sequence length of 1 on a null "
            "slot, zeroed rows), or make the op read only the real rows.")


def padding_reaches(graph: str, padded: str) -> str:
    return (f"A replay of {graph} gives its real rows other results than the same step run on the real rows alone: "
            f"what the padded rows hold ({padded}) reaches the real rows -- through a reduction over rows, a "
            "lookup a padded row's index steers, metadata a padded row overwrites. Padded rows must change nothing a "
            "real row gets: neutralise them before the replay (the values the kernel skips), or mask them inside the "
            "captured code.")


def padding_writes_owned(state: str, op: str) -> str:
    return (f"The padded rows of this replay write {state} ({op}) where real rows keep their data: an index that a "
            "padded row holds, or that the captured code derives from it (a clamp of -1 to 0, a modulo), names a "
            "live slot, and the padded row's update lands there. Give padded rows a slot no request owns (a "
            "reserved null slot), or make the kernel skip them (-1 checked before any clamp).")


def padded_scatter(op: str, index: str, state: str) -> str:
    return (f"{op} runs over every row of the padded batch and writes {state} through the index in `{index}`. A "
            "padded row's index names a slot that holds a real request's state -- one of this step's real rows, or a "
            "request parked for this step that wrote it earlier -- so that slot gets the padded row's update too, "
            "an update its request never asked for. Padded rows need slots of their own (one null slot they "
            "share).")


def dummy_batch(check: str, phase: str) -> str:
    return (f"The check `{check}` failed during a {phase}, on a batch the runner built for it rather than a real step. "
            "Real steps carry what the check asks for, so the run without graphs passed it every time; the dummy "
            "batch built for warmup and capture (its metadata made by another path, fields left None, lengths of "
            "zero) does not. Build the dummy batch the way a real step is built, or let the code accept what a "
            "dummy batch holds.")


def padded_layout_mismatch(graph: str, size: int, real: int, other: str | None = None) -> str:
    """``other``: a graph captured for ``real`` rows, when there is one. Then the smaller tensor need not be
    sized for this step's real requests at all: it may be one cut for that graph (a view bound while it
    was captured or served, and kept), and the text must not claim more than the shapes show."""
    if other is not None:
        return (f"{graph} was captured for {size} rows, and eager code around a step of it combined a tensor of "
                f"those {size} rows with one of {real} rows, the size {other} was captured for: that tensor was "
                "cut for the real requests or for that other graph (a view kept from its capture or its last "
                "replay) -- the shapes alone do not tell which. They disagree and the step fails -- or, where "
                "they happen to broadcast, rows get another step's values. Size each step's tensors from this "
                "step's counts, never from a view an earlier capture or replay left in Python state.")
    return (f"{graph} was captured for {size} rows, and eager code preparing a step for it combined a tensor of those "
            f"{size} rows (padded rows included) with one of {real} rows, sized for the real requests only: the "
            "shapes disagree and the step fails before its replay -- or, where they happen to broadcast, the "
            "padded rows get the real rows' values. Size per-request quantities to the padded count, or write "
            "them into the real rows' slice only.")


def padded_shape_mismatch(graph: str, real: int, size: int) -> str:
    return (f"A replay of {graph} served {real} real rows at its captured size {size}, so its outputs have "
            f"{size} rows, padded rows included. Eager code after the replay combined them with tensors built for "
            f"the {real} real rows (per-request indices, lengths or parameters): the shapes disagree, and the code "
            "asserts, fails to broadcast or indexes out of range -- or, where the shapes happen to broadcast, "
            "computes with the padded rows.")


def padded_count(function: str, name: str, size: int) -> str:
    return (f"The served step reached {function} with `{name}` of size {size}, the padded count a graph was captured "
            f"for; the run without graphs reaches it with the real counts only. Code there combines the padded count "
            "with something sized for the real rows (a valid span recorded for the scheduled tokens, a per-request "
            "list, a check of one against the other) and fails. Hand it the real count, or let it accept the padded "
            "rows (they hold inert values: read them as such, or slice them off).")
