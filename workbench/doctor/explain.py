"""The plain-language root cause of each finding kind, filled in with what was observed."""
from __future__ import annotations

MUTATION_PATTERNS = {
    "accumulating": "every replay changes it again, so rows the runner does not refresh before a replay "
                    "(padded rows) drift further with each step",
    "overwriting": "the first replay changes it and later ones write the same values, so rows the runner "
                   "does not refresh keep the graph's values instead of the runner's",
    "not probed": "the graph was not replayed while watched, so the effect was not measured",
}


def mutation(op: str, name: str, owner: str, pattern: str) -> str:
    return (f"{op} runs inside the graph and writes `{name}`, a static input buffer of {owner} that the graph "
            f"does not own. Each replay re-runs that write on the same memory: {MUTATION_PATTERNS[pattern]}.")


def mutation_evidence(name: str, pattern: str, numbers: dict) -> str:
    text = (f"{pattern}: {numbers['rows_changed']} of {numbers['rows']} rows of {name} changed after one extra "
            "replay on identical inputs")
    if "max_change_1" in numbers:
        text += (f"; max |change| {numbers['max_change_1']:g} after one replay, {numbers['max_change_2']:g} "
                 "after two")
    return text


def eager_update(op: str, name: str, owner: str) -> str:
    return (f"{op} runs outside the graphs, in eager code around them (as with PIECEWISE graphs), and updates "
            f"`{name}`, a static input buffer of {owner}, in place, reading what is there. The runner rewrites "
            "only the real rows each step, so rows it does not rewrite -- padded rows -- keep each step's "
            "result and the next step builds on it: the values drift with every step until they are out of range.")


def warmup_update(op: str, name: str, owner: str) -> str:
    return (f"{op} updates `{name}`, a static input buffer of {owner}, in place during the warmups, reading what "
            "is there: each warmup starts from what the previous one left instead of the dummy batch as prepared, so "
            "the inputs drift (lengths past what was allocated) and the later warmups and the capture run on data "
            "nobody prepared. Put the prepared inputs back after every warmup and after the capture, or update a copy.")


def eager_update_evidence(name: str, numbers: dict) -> str:
    return (f"accumulating: its call {numbers['call']} changed again {numbers['rows_changed']} of {numbers['rows']} "
            f"rows of {name} that its previous call had written and nothing outside the model has rewritten since "
            f"(first row {numbers['first_row']}: {numbers['was']:g} -> {numbers['now']:g})")


def zero_sized(name: str, shape: tuple) -> str:
    return (f"The capture input `{name}` {shape} has a zero-sized dimension, so the graph is captured for no "
            "data: each item of the capture batch gets nothing (per-item outputs of size 0), and code that "
            "reshapes per item fails or silently returns empty results.")


def overflow(name: str, data: tuple, buffer: tuple) -> str:
    return (f"The static buffer `{name}` {buffer} was sized at capture for less than this batch {data}: the "
            "copy fails, or with a clamped slice would drop the rows that do not fit.")


def overflow_view(name: str, shape: tuple, have: int) -> str:
    return (f"The code lays a tensor of shape {shape} over `{name}`, whose storage holds only {have} bytes: the buffer "
            "was sized for smaller data (an earlier request's) than this step brings. Torch refuses the view; code "
            "that lays a tensor over the raw pointer writes past the end, into whatever was allocated next. Size the "
            "buffer for the largest data a step can bring, or check the size and fall back.")


def dangling(tensor: str, op: str, origin: str, released: str | None = None) -> str:
    let_go = f" at {released}" if released else " after capture"
    return (f"The graph reads the {tensor} tensor through {op} but does not own it: it was created {origin} "
            f"and its last owner released it{let_go}. A graph keeps only the address: a replay reads "
            "freed memory (an illegal memory access, or another tensor's data once the allocator reuses "
            "the block).")


def released_in_place(tensor: str, op: str, where: str) -> str:
    return (f"{op} reads a {tensor} tensor whose storage was freed in place at {where} (its memory given up, "
            "the tensor kept): whoever released it took the memory away from a reference still in use -- a graph "
            "tree freeing the outputs of its previous generation while a cache or the next call still holds them. "
            "On a GPU the read is of freed memory: an illegal memory access, or another tensor's data.")


def warmup(missing: int, first: str) -> str:
    return (f"The warmup before this capture ran {missing} op(s) from code the capture never executed, first "
            f"{first}. Work done once during warmup (lazy initialisation of a state object that the capture "
            "then reuses) is not in the graph: every replay uses what warmup computed for the dummy batch.")


def overwritten(op: str, graph: str, generation: int, now: int, writer: str | None = None) -> str:
    if writer is None or writer == graph:
        return (f"{op} reads an output of replay {generation} of {graph}, but the graph has replayed since (replay "
                f"{now}) and wrote its new outputs to the same memory: the values read are the newer replay's.")
    return (f"{op} reads an output of replay {generation} of {graph}, but {writer} writes the same memory (an output "
            f"buffer the graphs share) and has replayed since: the values read are {writer}'s.")


def sync(op: str, host_read: bool = True) -> str:
    why = ("needs the device's values on the host while the graph is being captured; a CUDA graph cannot wait for "
           "the device" if host_read else "(a synchronisation, a driver call unsafe there): CUDA refuses it")
    return f"{op} {why}, so the capture fails (cudaErrorStreamCaptureUnsupported)."


def sync_elsewhere(op: str, mode: str) -> str:
    if mode == "global":
        return (f"{op} ran on another thread during the capture: in 'global' mode (torch's default) CUDA forbids "
                "every thread, not only the capturing one, to wait for the device while a capture is open. The wait "
                "fails on its thread and the capture fails at its end. Capture with capture_error_mode="
                "\"thread_local\" (other threads may then read values), or capture before other threads serve.")
    return (f"{op} ran on another thread during the capture: a device-wide synchronize (a synchronous copy on the "
            f"legacy default stream too) waits for the capturing stream, which CUDA refuses in every capture mode, "
            f"{mode!r} included. The wait fails on its thread and the capture fails at its end. Make that thread's "
            "work asynchronous on its own stream (cudaMemcpyAsync, a stream's synchronize), or capture before "
            "other threads serve.")


def dangling_pool(tensor: str, op: str, owner: str, how: str) -> str:
    return (f"The graph reads the {tensor} tensor through {op}; that tensor is an output of {owner}, captured into "
            f"the same pool. {owner} was {how} afterwards, so its memory belongs to the pool again and the next "
            "capture or allocation from it is handed the same block: the replay reads another tensor's data.")


def overflow_slice(name: str, dim: int, end: int, length: int) -> str:
    return (f"The code asks for elements [.., {end}) of dimension {dim} of the static buffer `{name}`, which has only "
            f"{length}: the step has more rows or columns than the buffer was made for. A slice clamps silently, "
            f"dropping {end - length} of them from whatever is written through it or read from it; `narrow` raises.")


def clamped_slice(dim: int, end: int, length: int, made: str) -> str:
    return (f"A slice asked for elements [.., {end}) of dimension {dim} of a tensor that has {length} (made at {made}), "
            "and silently gave only those; an op then failed on the short view. Size the tensor for the largest "
            "step it serves (the largest graph size a dummy run pads to), or slice no more than it holds.")


def failed_write(name: str, error: str) -> str:
    return f"A write into the static buffer `{name}` failed: {error}. The buffer was sized at capture for less than this data."


def negative_size(error: str) -> str:
    return (f"A tensor was asked for with a negative size ({error}): the computation that sizes this buffer "
            "gives a negative number for some input it meets (an empty input, a length that went below zero). "
            "Size each buffer from what it must hold, and check a computed count before allocating with it.")


def unmatched_layout(name: str, rows: int, step_rows: int) -> str:
    return (f"`{name}` is laid out for {rows} rows while the graph being prepared runs {step_rows}: the buffer's "
            "layout was computed for another token layout (the padded, largest one) than the batch this graph is "
            "captured for. Lay the buffer out from the graph's own batch (its runtime draft length, its padded size).")


def reused_output_value(graph: str) -> str:
    return (f"A replay of {graph} rewrites its outputs in place and hands out the same tensor objects again. A value "
            "computed from an output and cached by the tensor's identity (autocast's weight-cast cache, a memo keyed by "
            "`id(t)`) is found again at the next step and holds the earlier step's values. Do not cache what is computed "
            "from a graph's outputs, or hand out a copy each step.")


def reset_input(name: str) -> str:
    return (f"`{name}` is a static input: the runner writes each step's data there and every reader of the step "
            "(each metadata builder, the capture's dummy run, the graph) reads that one buffer. Code that resets it "
            "in place blanks the step's input for every reader after it. Reset a copy of your own, or only memory "
            "that nothing else reads.")


def unwritten_input(name: str, other: str) -> str:
    return (f"`{name}` still holds what its allocation left: the preparation of the capture's dummy batch wrote "
            f"`{other}` and the other inputs but not this one, which only the runtime path fills. Write every "
            "static input the captured code reads when preparing the dummy batch (the same hook on both paths), "
            "or fill it with a valid placeholder when it is made.")


def unfit_write(error: str) -> str:
    return (f"A write failed because its data does not fit its destination: {error.rstrip('.')}. The buffer was sized (at "
            "start-up, or by a warmup or capture's dummy batch) for less than what this step writes into it; "
            "on a GPU a kernel writing past it corrupts the memory after it.")


def misshaped_input(name: str, shape: tuple, error: str) -> str:
    return (f"The captured code failed on the static input `{name}` (shape {shape}): {error}. A warmup and a "
            "capture run the model on the runner's buffers, not on a step's own tensors: this buffer was made "
            "for another width or length than the model computes with, so no capture of it can be right (and a "
            "live step's data would not fit it either). Size it from the same configuration the model uses.")


def over_served(what: str, real: int, captured: int) -> str:
    return (f"A replay was announced to serve {real} {what} but the graph was captured for {captured}: the graph "
            "computes only the captured ones, so the rest are silently dropped or read out of bounds.")


def live_state(name: str, owner: str, before: bool = False) -> str:
    when = ("the workload's own data, written before it was announced; the workload's results differ from its "
            "run without graphs and nothing else explains them" if before else "written since it was announced")
    return (f"A warmup run writes `{name}`, persistent state of {owner}, in rows that already hold live data "
            f"({when}). A warmup runs the model on a dummy batch, or on the live state itself; where it writes "
            "into rows of running requests (a re-capture after serving started) or advances the state a step "
            "(a capture deferred to the first real step), what follows continues from corrupted state. Keep a "
            "warmup's writes out of live state: warm up on scratch state, or save and restore it around the warmup.")


def differential(graph: str, what: str, site: str) -> str:
    return (f"A replay of {graph} gave other results than an eager run of the same step on the same inputs and "
            f"state ({what}). The graph replays what Python decided at capture; the eager run decides again "
            f"now. {site}")


def reference_run(graph: str, why: str) -> str:
    return (f"A replay of {graph} gave other results than the same step of the workload run without graphs: what "
            f"is wrong is what the capture froze into the captured callable or what the runner prepares before "
            f"each replay ({why}).")


def uncomputed(graph: str, op: str, cached: bool = False) -> str:
    head = (f"A capture records kernels and computes nothing that lasts: the tensors {graph}'s capture made are "
            f"where its replays will write, not results, until it has been replayed once. {op} read them first: ")
    if cached:
        return head + ("this function kept a tensor it made while it was being captured (a table built on first use "
                       "and cached), and its later calls read it (on a GPU, whatever that memory held before). Build "
                       "such state outside the capture (in a warmup or at load), or do not cache what a capture made.")
    return head + ("the step that captured handed on what the capture returned instead of replaying (on a GPU, "
                   "whatever that memory held before). Replay the graph after capturing it, and return what the "
                   "replay wrote.")


def handed_on_input(first: str, second: str, graph: str) -> str:
    return (f"The buffer {graph} reads as its static input {first} was handed on as {second} while {graph} still "
            f"reads it: every copy-in for {second} overwrites what {graph} reads, and its replays compute from "
            "another tensor's data (a reuse pool taking back a graph input after the capture, as if nothing read it "
            "later). Keep a graph's input buffers for as long as any graph that reads them lives.")


def lost_update(buffer: str) -> str:
    return (f"One static input holds the data of several consumers: the same code copies into {buffer} for each of "
            "them before the graph reads it (the metadata of two draft steps built into one buffer before one "
            "replay), so the graph reads the last consumer's data for all of them. Give each consumer a buffer of its "
            "own, or replay between the writes.")


def restaged() -> str:
    return ("One pinned host buffer stages every step's data for an asynchronous copy to the device, and the host "
            "writes the next step's data into it before the previous step's copy has read it. A non_blocking copy "
            "reads pinned memory when the stream reaches it, so a host running ahead of the device (an overlap "
            "scheduler) sends the previous step the next step's data. Stage each step into fresh pinned memory (the "
            "caching host allocator keeps a block until its copy has run), or wait on an event recorded after the "
            "copy before writing the buffer again.")


def unread_copy(buffer: str, graph: str) -> str:
    return (f"The step copied data into {buffer} where {graph} never reads: the graph reads the views of {buffer} "
            "its capture read, sized for the batch it was captured on, so the rest of this step's data is dropped "
            "without an error. Capture each size on views of its full size (dummy inputs of the bucket's size, not "
            "the first real batch), and serve a batch only with a graph captured for at least its size.")


def passed_over(buffer: str, graph: str) -> str:
    return (f"The code {graph} captured reads {buffer} only on a path Python did not take during the capture (a "
            "branch decided on the dummy batch, an argument the capture was not given): the graph holds no kernel "
            f"that reads it, so every replay ignores the data the runner brings, while an eager step of the same "
            "batch takes that path. Make the decision an input of the graph (a static buffer the kernels read), a key "
            "of the graph (capture each path), or a reason to run eagerly.")


def short_window(buffer: str, graph: str) -> str:
    return (f"{graph} was captured reading a view of {buffer} with fewer rows than the steps it serves: the view is "
            "fixed at capture, so the data a step writes past it is never read, and what those rows stand for (a "
            "token's cache slot, a request's length) silently goes missing. Build the capture-time view from the "
            "capture size (tokens for per-token buffers), not from another count.")


def lookup_past_end(buffer: str) -> str:
    return (f"A warmup or capture runs the runner's own dummy batch of the capture size, and it needs more of "
            f"{buffer} than the buffer holds: a kernel indexes past its end (on a GPU an illegal memory access, or "
            f"silently another buffer's memory). Size {buffer} for the largest batch each capture size can carry, "
            "or cap the capture sizes at what the buffers hold.")


def by_value(op: str, value) -> str:
    return (f"{op} takes a 0-dim host tensor, which CUDA passes to the kernel by value: the graph keeps the number "
            f"it held at capture ({value!r}), and a replay never reads the tensor the step makes now. Keep the value "
            "in a persistent device tensor the step writes in place (`self.k[0] = value`), which the graph reads "
            "by address at every replay.")


def size_table(lookup: str, largest: int) -> str:
    return (f"The step asked {lookup} for a size past the largest one a graph was captured for ({largest}): the "
            "table of capture sizes ends there, and the step dies. A batch larger than every graph must take "
            "the eager path; the check that sends a batch to the graphs must compare the quantity the graphs are "
            "sized by (tokens, not requests, with several tokens per request) with the largest capture size.")


def index_past_table(table: str, size: int) -> str:
    return (f"A real request's own index runs past the end of {table} ({size} entries): no padded row is to "
            "blame, the table is smaller than the indices requests bring (a stash sized by the batch or the "
            "capture size but indexed by request slot, token position or block id). On a GPU an illegal memory "
            f"access, or a silent read of other memory. Size {table} by the range of the index that looks it up "
            "(the request pool, the longest context), not by the batch.")


def update_in_a_copy(op: str, buffer: str) -> str:
    return (f"The captured {op} updates {buffer} in place, but {buffer} is a copy: the runner fills it from the "
            "tensor that holds the state before every replay and never copies the update back, so the next "
            "copy overwrites it (eager code, working on that tensor itself, keeps it). Hand the graph the state "
            "tensor itself as a static input (mark it static, do not copy it), or copy the updated elements back "
            "after each replay.")


def derived_before_capture(tensor: str, source: str) -> str:
    return (f"{tensor} was computed from the static input {source} outside the capture (before the warmups, when "
            "a metadata object was built), so the graph recorded only its read: every replay reads the value computed "
            f"for the capture's dummy batch, while the runner refreshes {source} each step. Compute it inside the "
            "captured region (build the object in the captured callable), or recompute it into the same memory "
            "before every replay.")


def carried_input(buffer: str, op: str) -> str:
    return (f"The graph reads {buffer} ({op}) at every replay, and this step left some of its elements as an earlier "
            "step wrote them: a replay reads whatever is there, while the step's own inputs would have said "
            "otherwise (an input the step omitted, a refresh skipped because nothing seemed to change). Write every "
            f"element of {buffer} the graph reads before each replay -- the neutral value the eager path assumes "
            "when the step brings no such input -- or, if carrying it across steps is intended, announce it as "
            "persistent state.")


def startup_write(tensor: str, op: str) -> str:
    return (f"The runs made before capture (warmups on dummy inputs) wrote {tensor} with {op}, and a real step "
            "reads what they left there: its answer depends on the dummy batches. Memory that outlives the warmups "
            "(caches, recurrent state, null blocks that masked reads rely on) must leave them as it was: send dummy "
            "writes to a scratch slot, or save that memory before the warmups and put it back before serving.")


def pool_handed_on(tensor: str, producer: str, writer: str, handed_on: bool, output: bool) -> str:
    if handed_on and output:
        return (f"The {tensor} is an output of {producer}, allocated during its capture from the shared graph pool, "
                f"in memory that {writer} had freed during its own capture; {writer}'s replays still write there, "
                f"so each of them overwrites {producer}'s output. Graphs whose outputs are read after other graphs "
                "replay need memory those graphs do not use: a pool of their own, or the output copied out.")
    if handed_on:
        return (f"The {tensor} was allocated during the capture of {producer}, from the shared graph pool, in memory "
                f"that {writer} had freed during its own capture; {writer}'s replays still write there. The graph "
                "that reads it across replays finds whatever the last of them wrote. Memory that must keep its "
                "value from one replay to the next belongs outside the graph pool: allocate it before capturing.")
    return (f"The graph reads the {tensor} that {producer} produces, but {writer}'s replay wrote the same memory after "
            f"{producer}'s last replay: it reads another graph's data. Replay {producer} right before the graph "
            "that reads its output, or copy the output out before any other graph of the pool replays.")


def decision_mismatch(decision: str, graph: str) -> str:
    return (f"The runner checks, before replaying {graph}, that the step decided as the capture did, and "
            f"{decision} says otherwise: the code that built this step's state never took the decision the "
            "capture of that graph took (a route, a mode, a layout left at its default). Take that decision "
            "the same way on every path that reaches the graph (an idle or dummy step too), or key the graphs on it.")


def host_left(container: str, graph: str) -> str:
    return (f"A replay of {graph} runs no Python: what the captured step's Python does besides launching kernels "
            f"(here to {container}: a transfer queued, a request's bookkeeping, a count) ran at capture, if the "
            "capture's path reached it, and never again. Code after the step finds what the replays left. Do that "
            "host work outside the captured region, from the step's metadata, before or after the replay.")


def capture_path(function: str, graph: str) -> str:
    return (f"{graph}'s capture ran {function} once and took one path through it; its replays repeat that path, "
            f"whatever a later step asks. The run without graphs took another path through {function} (the lines "
            "named), which no replay can take: capture every path a served step may need (a graph per case, keyed "
            "on what decides the branch), or run such steps eagerly.")


def left_installed(function: str, graph: str) -> str:
    return (f"{graph}'s capture ran {function}, which the workload's run without graphs never calls, and the served "
            f"run's own eager code calls it too: what the graph set-up installed for the capture (a wrapper over a "
            "module's forward, a hook, a context entered for it) outlived the capture, so eager steps go on with "
            "what was decided for the capture. Install such wrappers only around the capture, and restore what they "
            "replaced when it ends.")


def dropped_work(op: str, function: str, carried: bool = False) -> str:
    if carried:
        return (f"The run without graphs launches {op} at every step: a reset of memory the step then adds into. "
                f"The served run launched it only while {function} prepared the graph, outside any capture, and the "
                "graph reads and rewrites what it wrote: every replay starts from what the replay before it left "
                "(gradients accumulate across steps). Capture the reset inside the graph, or redo it before every "
                "replay.")
    return (f"The run without graphs launches {op} at every step, on that step's inputs. The served run launched it "
            f"only while {function} prepared the graph, outside any capture, and the graph reads its result: "
            "every replay gets the value of that one run. Whatever decided the work does not depend on the step "
            "(a dependence walk that missed a path, a plan hoisted out of the step) was wrong: capture the work "
            "inside the graph, or redo it before every replay.")


def stale_pool(graph: str, first: str) -> str:
    return (f"A graph pool lives while a graph captured into it does. {first} and the others captured into this pool "
            f"were reset or dropped while memory of the pool is still held (an output kept), so the pool is waiting "
            f"to be freed, and the handle the program kept now names a released pool: the capture of {graph} into it "
            "is refused (on CUDA, the caching allocator's INTERNAL ASSERT use_count > 0). Take a fresh "
            "graph_pool_handle() for a new set of graphs, or keep the handle with the graphs that use it (not at "
            "class or module scope), and let go of the old outputs.")


def past_extent(buffer: str, has: int, reached: int) -> str:
    return (f"The write goes through a view made with as_strided over {reached} bytes from where {buffer} starts, "
            f"which holds {has}: the bytes past its end belong to whatever was allocated next to it (another "
            "buffer of the same arena, a graph's state), and no shape check stops it. Allocate the buffer for "
            "everything written through it (a kernel's scratch included), or give the scratch its own allocation.")


def aliased_in_capture(tensor: str, taker: str) -> str:
    return (f"The {tensor} was made from a pointer (a weak reference such as vLLM's weak_ref_tensors, or from_blob): "
            "it keeps nobody's memory alive. Its owner, a tensor of this capture or of an earlier one in the same pool, "
            f"was released, and the allocator gave that memory to the output of {taker} in this capture: the graph now "
            "reads and writes it through both, on every replay. Keep a strong reference for as long as a graph reads "
            "it (until the capture ends, or until the last graph of the pool that reads it is captured), and take "
            "weak references only after that (the caching allocator may place things differently on another "
            "machine: the numbers can look right here and be wrong there).")


def bound_in_capture(holder: str, graph: str, rows: int, size: int) -> str:
    return (f"`{holder}` is assigned by Python inside the captured region, so the assignment ran when {graph} was "
            f"captured and never runs at a replay: it still holds the {rows}-row tensor that capture handed in. Eager "
            f"code of a later step ({size} rows) reads it and gets that capture's tensor -- of another size, or with "
            "values that stop at that capture's rows. Pass per-step state to the code that reads it (an argument, a "
            "context set every step outside the graph), not through an attribute a captured region binds.")
