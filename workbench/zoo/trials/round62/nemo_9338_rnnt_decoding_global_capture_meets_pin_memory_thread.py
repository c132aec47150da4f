"""RNN-T decoding graphs are captured in "global" mode: the pin-memory thread's event query lands in the capture.

Upstream: https://github.com/NVIDIA-NeMo/Speech/pull/9338 ("Re-enable cuda graphs in training modes.", merged 2024-05;
then NVIDIA/NeMo).
Symptom: "global" capture mode "was sporadically crashing because of pinning host memory in other threads spawned by
the data loader when num_workers > 0": the ``ASR_dev_run_Speech_To_Text_HF_Finetuning`` CI test (fine-tuning with
validation, ``num_workers=1``) failed about 1 run in 5, at the first validation decode.
Mechanism: in ``validation_step`` the greedy-batch decoder (``GreedyBatchedRNNTLoopLabelsComputer``) lazily calls
``_graph_reinitialize`` on its first batch and captures its graphs (``_partial_graphs_compile``: ``before_outer_loop``,
``before_inner_loop``, ``inner_loop_code``, ``after_inner_loop``, replayed by ``active_mask_any.item()`` /
``advance_mask_any.item()`` host loops) with ``torch.cuda.graph(g, stream=stream_for_graph)``: the default
``capture_error_mode="global"`` prohibits potentially unsafe CUDA calls in *every* thread while the capture is open.
Meanwhile the pin-memory thread pins the next batch: ``pin_memory()`` goes through the ``CachingHostAllocator``,
whose ``process_events`` calls ``cudaEventQuery`` on the events recorded when earlier pinned batches were copied to
the GPU with ``non_blocking=True`` (then ``cudaHostAlloc``). Under a global capture that query is refused and the
capture invalidated. In the model the other threads run while a capture is open (``yield_to_other_threads``):
under a global capture their calls run on the capturing thread, where the capture refuses them as CUDA does process-
wide; a thread_local capture never sees them, so they run once no capture is open (equivalent: nothing joins it).
Doctor: sync-in-capture, at ``process_events`` (the pin-memory thread's ``cudaEventQuery`` lands inside the
decoder's global-mode capture).
Fix (upstream): the decoders' captures pass ``capture_error_mode="thread_local"`` (``_partial_graphs_compile``,
``_full_graph_compile``, ``RNNTGreedyDecodeCudaGraph._reinitialize``), and CUDA graphs are re-enabled for decoding
in training/validation. (Read: the PR description and test recipe, and the post-fix ``rnnt_loop_labels_computer.py``
and ``cuda_graph_rnnt_greedy_decoding.py``; not the diff: the repository snapshot is too large to fetch.)
"""
from __future__ import annotations

import contextlib

import torch

from workbench.engine import events, graph, host, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA-NeMo/Speech/pull/9338"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "process_events"
SYMPTOM = "the first validation decode's capture fails: the pin-memory thread's event query hits a global capture"

VOCAB, FEAT, HIDDEN, BATCH, TIME, MAX_SYMBOLS, BATCHES = 5, 3, 6, 3, 4, 2, 4
BLANK = VOCAB                        # blank_as_pad: the last class, zero embedding

OPEN_CAPTURES: list[str] = []        # capture_error_mode of each capture open in the process
OTHER_THREADS: list = []             # work the process's other threads have to do


def yield_to_other_threads():
    """The process's other threads run now. A global-mode capture open anywhere prohibits their unsafe CUDA calls
    (run here, inside it); a thread_local one never sees them (they run once no capture is open)."""
    if OPEN_CAPTURES and "global" not in OPEN_CAPTURES:
        return
    while OTHER_THREADS:
        OTHER_THREADS.pop(0)()


@contextlib.contextmanager
def cuda_graph(g, capture_error_mode, name):
    """``torch.cuda.graph(g, stream=stream_for_graph, capture_error_mode=...)``."""
    with graph(g, name=name):
        OPEN_CAPTURES.append(capture_error_mode)
        try:
            yield
            yield_to_other_threads()          # capturing takes a while: the other threads keep running
        finally:
            OPEN_CAPTURES.pop()


class CachingHostAllocator:
    def __init__(self, device):
        self.device, self.events = device, []

    def record_event(self, block):
        """A ``non_blocking`` H2D copy read ``block``: it may be reused once the stream passes this event."""
        flag = torch.zeros((), dtype=torch.int32, device=self.device)
        flag.fill_(1)                         # cudaEventRecord: the stream sets it when it gets there
        self.events.append((flag, block))

    def process_events(self):
        while self.events:
            flag, _ = self.events[0]
            if not bool(flag.item()):         # cudaEventQuery
                break
            self.events.pop(0)

    def allocate(self, t):
        """``t.pin_memory()``: retire completed blocks, then ``cudaHostAlloc``."""
        self.process_events()
        return host(t.clone(), self.device)


class DataLoader:
    """``num_workers=1, pin_memory=True``: batch k+1 reaches the pin-memory thread while batch k is validated."""

    def __init__(self, batches, allocator):
        self.batches, self.allocator, self.ready = batches, allocator, {}

    def _pin_memory_loop(self, k):
        self.ready[k] = (self.allocator.allocate(self.batches[k][0]), self.batches[k][1])

    def __iter__(self):
        OTHER_THREADS.append(lambda: self._pin_memory_loop(0))
        for k in range(len(self.batches)):
            yield_to_other_threads()                          # _get_data waits on the pin-memory queue
            if k + 1 < len(self.batches):                     # meanwhile the worker hands batch k+1 over
                OTHER_THREADS.append(lambda k=k + 1: self._pin_memory_loop(k))
            yield self.ready.pop(k)


class BatchedHyps:
    def __init__(self, device):
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        self.transcript = z(BATCH, TIME * MAX_SYMBOLS + 1)
        self.current_lengths, self.last_timestep, self.last_timestep_lasts = z(BATCH), z(BATCH), z(BATCH)
        self.scores = torch.zeros(BATCH, device=device)
        self._batch_indices, self._ones_batch = torch.arange(BATCH, device=device), z(BATCH) + 1

    def clear_(self):
        for t in (self.transcript, self.current_lengths, self.last_timestep_lasts, self.scores):
            t.fill_(0)
        self.last_timestep.fill_(-1)

    def add_results_masked_no_checks_(self, active_mask, labels, time_indices, scores):
        self.scores.add_(active_mask * scores)
        self.transcript[self._batch_indices, self.current_lengths] = labels
        same = self.last_timestep == time_indices
        lasts = self.last_timestep_lasts
        torch.where(active_mask & same, lasts + 1, lasts, out=lasts)
        torch.where(active_mask & ~same, self._ones_batch, lasts, out=lasts)
        torch.where(active_mask, time_indices, self.last_timestep, out=self.last_timestep)
        self.current_lengths.add_(active_mask)


class LoopLabelsState:
    def __init__(self, device):
        lng, msk = ({"dtype": d, "device": device} for d in (torch.long, torch.bool))
        self.encoder_output_projected = torch.zeros(BATCH, TIME, HIDDEN, device=device)
        (self.encoder_output_length, self.labels, self.time_indices, self.safe_time_indices,
         self.time_indices_current_labels, self.last_timesteps) = (torch.zeros(BATCH, **lng) for _ in range(6))
        self.batch_indices = torch.arange(BATCH, device=device)
        self.scores = torch.zeros(BATCH, device=device)
        self.active_mask, self.advance_mask, self.blank_mask = (torch.zeros(BATCH, **msk) for _ in range(3))
        self.active_mask_any, self.advance_mask_any = torch.zeros((), **msk), torch.zeros((), **msk)
        self.decoder_state, self.decoder_output = (torch.zeros(BATCH, HIDDEN, device=device) for _ in range(2))
        self.batched_hyps = BatchedHyps(device)


class GreedyBatchedRNNTLoopLabelsComputer:
    def __init__(self, model, variant, device, use_cuda_graphs):
        self.m, self.variant, self.device, self.use_cuda_graphs = model, variant, device, use_cuda_graphs
        self.state = self.separate_graphs = None

    def joint_after_projection(self, f, g):
        return torch.relu(f + g) @ self.m.w_out

    def _before_outer_loop(self):
        s = self.state
        s.batched_hyps.clear_()
        s.labels.fill_(BLANK)                                 # SOS = blank
        s.decoder_state.fill_(0.0)
        for t in (s.time_indices, s.safe_time_indices, s.time_indices_current_labels):
            t.fill_(0)
        torch.sub(s.encoder_output_length, 1, out=s.last_timesteps)
        torch.greater(s.encoder_output_length, 0, out=s.active_mask)
        torch.any(s.active_mask, out=s.active_mask_any)

    def _before_inner_loop_get_decoder_output(self):
        s = self.state
        s.decoder_state.copy_(torch.tanh(self.m.embed[s.labels] + s.decoder_state @ self.m.w_h))   # decoder.predict
        s.decoder_output.copy_(s.decoder_state @ self.m.w_pred)                                       # project_prednet

    def _advance(self):
        s = self.state
        torch.eq(s.labels, BLANK, out=s.blank_mask)
        s.time_indices.add_(s.blank_mask)
        torch.minimum(s.time_indices, s.last_timesteps, out=s.safe_time_indices)
        torch.less(s.time_indices, s.encoder_output_length, out=s.active_mask)
        torch.logical_and(s.active_mask, s.blank_mask, out=s.advance_mask)
        torch.any(s.advance_mask, out=s.advance_mask_any)

    def _before_inner_loop_get_joint_output(self):
        s = self.state
        logits = self.joint_after_projection(s.encoder_output_projected[s.batch_indices, s.safe_time_indices],
                                             s.decoder_output)
        torch.max(logits, -1, out=(s.scores, s.labels))
        s.time_indices_current_labels.copy_(s.time_indices)
        self._advance()

    def _inner_loop_code(self):
        s = self.state
        torch.where(s.advance_mask, s.time_indices, s.time_indices_current_labels, out=s.time_indices_current_labels)
        logits = self.joint_after_projection(s.encoder_output_projected[s.batch_indices, s.safe_time_indices],
                                             s.decoder_output)
        more_scores, more_labels = logits.max(-1)
        torch.where(s.advance_mask, more_labels, s.labels, out=s.labels)
        torch.where(s.advance_mask, more_scores, s.scores, out=s.scores)
        self._advance()

    def _after_inner_loop(self):
        s, hyps = self.state, self.state.batched_hyps
        hyps.add_results_masked_no_checks_(s.active_mask, s.labels, s.time_indices_current_labels, s.scores)
        force_blank_mask = (s.active_mask & (s.labels != BLANK) & (hyps.last_timestep_lasts >= MAX_SYMBOLS)
                            & (hyps.last_timestep == s.time_indices))
        s.time_indices.add_(force_blank_mask)
        torch.minimum(s.time_indices, s.last_timesteps, out=s.safe_time_indices)
        torch.less(s.time_indices, s.encoder_output_length, out=s.active_mask)
        torch.any(s.active_mask, out=s.active_mask_any)

    def _graph_reinitialize(self):
        self.state = LoopLabelsState(self.device)
        if self.use_cuda_graphs:
            self._partial_graphs_compile()

    def _partial_graphs_compile(self):
        mode = "thread_local" if self.variant == "fix" else "global"      # the fix: capture_error_mode="thread_local"
        s, owner = self.state, "GreedyBatchedRNNTLoopLabelsComputer"
        events.static_buffers(owner, {"encoder_output_projected": s.encoder_output_projected,
                                      "encoder_output_length": s.encoder_output_length})
        events.persistent_state(owner, {"decoder_state": s.decoder_state, "labels": s.labels,
                                        "time_indices": s.time_indices, "transcript": s.batched_hyps.transcript})
        self.separate_graphs = {}                     # SeparateGraphsLoopLabels
        for name in ("before_outer_loop", "before_inner_loop", "inner_loop_code", "after_inner_loop"):
            g = self.separate_graphs[name] = new_graph(self.device)
            with cuda_graph(g, mode, name):
                self._code(name)

    def _code(self, name):
        if name == "before_inner_loop":
            self._before_inner_loop_get_decoder_output()
            self._before_inner_loop_get_joint_output()
        else:
            getattr(self, f"_{name}")()

    def _run(self, name):
        """CudaGraphsMode.NO_WHILE_LOOPS replays the part's graph; NO_GRAPHS (the eager reference) runs its code."""
        s = self.state
        if self.use_cuda_graphs:
            replay(self.separate_graphs[name], (s.active_mask_any, s.advance_mask_any))
        else:
            self._code(name)

    def loop_labels_cuda_graphs(self, encoder_output, encoder_output_length):
        encoder_output = encoder_output @ self.m.w_enc                 # joint.project_encoder
        if self.state is None:
            self._graph_reinitialize()
        s = self.state
        s.encoder_output_projected.copy_(encoder_output)
        s.encoder_output_length.copy_(encoder_output_length)
        self._run("before_outer_loop")
        while s.active_mask_any.item():
            self._run("before_inner_loop")
            while s.advance_mask_any.item():
                self._run("inner_loop_code")
            self._run("after_inner_loop")
        h = s.batched_hyps
        return [h.transcript.clone(), h.current_lengths.clone(), h.scores.clone()]


class EncDecRNNTModel:
    def __init__(self, device):
        gen = generator(9338)
        self.w_feat = randn(FEAT, HIDDEN, gen=gen, device=device)
        self.w_enc, self.w_h, self.w_pred = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(3))
        self.w_out = randn(HIDDEN, VOCAB + 1, gen=gen, device=device)
        self.embed = torch.cat([randn(VOCAB, HIDDEN, gen=gen, device=device), torch.zeros(1, HIDDEN, device=device)])

    def validation_step(self, computer, feats, lengths):
        encoded = torch.tanh(feats @ self.w_feat)                       # the encoder, eager
        return computer.loop_labels_cuda_graphs(encoded, lengths)


def run(variant: str, device: str = "cpu"):
    gen = generator(95)
    batches = [(torch.randn(BATCH, TIME, FEAT, generator=gen), torch.randint(1, TIME + 1, (BATCH,), generator=gen))
               for _ in range(BATCHES)]

    def fit_validation(use_cuda_graphs: bool):
        OPEN_CAPTURES.clear()
        OTHER_THREADS.clear()
        model, allocator = EncDecRNNTModel(device), CachingHostAllocator(device)
        computer = GreedyBatchedRNNTLoopLabelsComputer(model, variant, device, use_cuda_graphs)
        outs = []
        for pinned, lengths in DataLoader(batches, allocator):
            feats = pinned.to(device, non_blocking=True)                # batch_to_device
            allocator.record_event(pinned)
            outs += model.validation_step(computer, feats, lengths.to(device))
            yield_to_other_threads()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: fit_validation(True),
                   lambda: fit_validation(False))
