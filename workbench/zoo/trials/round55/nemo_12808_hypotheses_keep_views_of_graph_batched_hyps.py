"""Hypotheses keep views of the CUDA-graph decoder's static ``batched_hyps``: the next batch's replay rewrites them.

Upstream: https://github.com/NVIDIA/NeMo/pull/12808 ("clone timestams and y_sequence", commit d8a6b782).
Symptom: with ``use_cuda_graph_decoder=True`` the RNNT/TDT greedy decoder's hypotheses of earlier batches end up
with the ``y_sequence`` / ``timestamp`` of a later batch, while ``hyp.text`` (decoded before the next batch) still
matches the non-graph decoder; the PR's test now asserts ``torch.equal(act_y, fast_y)`` for every hypothesis.
Mechanism: ``GreedyBatchedRNNTLoopLabelsComputer.loop_labels_cuda_graphs`` keeps all decoding state in the
preallocated ``LoopLabelsState`` (``_graph_reinitialize``), copies the projected encoder output into
``state.encoder_output_projected``, replays ``full_graph`` (``_before_outer_loop`` clears ``batched_hyps``, the
while-loop conditional nodes run the inner/outer loops, ``_after_inner_loop`` writes
``transcript``/``timestamps`` in place) and returns ``self.state.batched_hyps`` itself.
``rnnt_utils.batched_hyps_to_hypotheses`` built each ``Hypothesis`` with ``y_sequence=transcript[i, :len]`` and
``timestamp=timestamps[i, :len]``: views of the graph's static buffers. ``transcribe`` keeps batch 1's hypotheses
while it decodes batch 2, whose replay rewrites those buffers. The non-graph ``loop_labels_torch`` allocates a
fresh ``BatchedHyps`` per call, so there the views stay valid. (Here the conditional while nodes are unrolled to
their static bound; the extra iterations change nothing within any hypothesis's length.)
Doctor: overwritten-output, at batched_hyps_to_hypotheses (it hands out slices of the replayed ``transcript`` /
``timestamps`` that ``transcribe`` reads after the next batch's replay has overwritten them).
Fix (upstream): ``.clone()`` on both slices in ``batched_hyps_to_hypotheses`` ("to avoid keeping references to
the tensors that can be allocated by CUDA graphs").
"""
from __future__ import annotations

import dataclasses
import types

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/12808"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "batched_hyps_to_hypotheses"
SYMPTOM = "earlier batches' hypotheses carry the last batch's y_sequence/timestamps; the text still matches"
BATCH, TIME, HIDDEN, VOCAB, MAX_SYMBOLS, INITIAL_MAX_TIME, NUM_BATCHES = 3, 5, 4, 5, 2, 6, 3
BLANK = VOCAB                                    # blank is the last class (blank-as-pad)


class BatchedHyps:
    def __init__(self, batch_size, init_length, device):
        z = lambda *s: torch.zeros(s, dtype=torch.long, device=device)  # noqa: E731
        self.current_lengths, self.transcript, self.timestamps = z(batch_size), z(batch_size, init_length), \
            z(batch_size, init_length)
        self.scores = torch.zeros(batch_size, device=device)
        self.last_timestamp = torch.full((batch_size,), -1, dtype=torch.long, device=device)
        self.last_timestamp_lasts = z(batch_size)
        self._batch_indices = torch.arange(batch_size, device=device)

    def clear_(self):
        for t in (self.current_lengths, self.transcript, self.timestamps, self.last_timestamp_lasts):
            t.fill_(0)
        self.scores.fill_(0.0)
        self.last_timestamp.fill_(-1)

    def add_results_masked_no_checks_(self, active_mask, labels, time_indices, scores):
        torch.where(active_mask, self.scores + scores, self.scores, out=self.scores)
        self.transcript[self._batch_indices, self.current_lengths] = labels
        self.timestamps[self._batch_indices, self.current_lengths] = time_indices
        same = self.last_timestamp == time_indices
        torch.where(active_mask & same, self.last_timestamp_lasts + 1, self.last_timestamp_lasts,
                    out=self.last_timestamp_lasts)
        torch.where(active_mask & ~same, torch.ones_like(self.last_timestamp_lasts), self.last_timestamp_lasts,
                    out=self.last_timestamp_lasts)
        torch.where(active_mask, time_indices, self.last_timestamp, out=self.last_timestamp)
        self.current_lengths += active_mask


@dataclasses.dataclass
class Hypothesis:
    score: float
    y_sequence: torch.Tensor
    timestamp: torch.Tensor
    text: str = ""


def batched_hyps_to_hypotheses(batched_hyps, batch_size, variant):
    """``rnnt_utils.batched_hyps_to_hypotheses``: one ``Hypothesis`` per utterance."""
    keep = (lambda t: t.clone()) if variant == "fix" else (lambda t: t)    # #12808: clone both slices
    return [Hypothesis(score=batched_hyps.scores[i].item(),
                       y_sequence=keep(batched_hyps.transcript[i, :batched_hyps.current_lengths[i]]),
                       timestamp=keep(batched_hyps.timestamps[i, :batched_hyps.current_lengths[i]]))
            for i in range(batch_size)]


class LoopLabelsState:
    def __init__(self, batch_size, max_time, device):
        self.batch_size, self.max_time = batch_size, max_time
        self.encoder_output_projected = torch.zeros(batch_size, max_time, HIDDEN, device=device)
        self.encoder_output_length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.batch_indices = torch.arange(batch_size, device=device)
        z = lambda dtype=torch.long: torch.zeros(batch_size, dtype=dtype, device=device)  # noqa: E731
        self.labels, self.scores = z(), z(torch.float32)
        self.time_indices, self.safe_time_indices, self.time_indices_current_labels = z(), z(), z()
        self.last_timesteps = z()
        self.active_mask, self.advance_mask, self.blank_mask = z(torch.bool), z(torch.bool), z(torch.bool)
        self.active_mask_any = torch.tensor(True, device=device)
        self.advance_mask_any = torch.tensor(True, device=device)
        self.decoder_state = torch.zeros(batch_size, HIDDEN, device=device)
        self.decoder_output = torch.zeros(batch_size, HIDDEN, device=device)
        self.batched_hyps = BatchedHyps(batch_size, max_time * MAX_SYMBOLS, device)


class GreedyBatchedRNNTLoopLabelsComputer:
    def __init__(self, weights, device, use_cuda_graphs):
        self.embed, self.w_pred, self.w_joint = weights      # prediction network and joint, in miniature
        self.device, self.use_cuda_graphs = device, use_cuda_graphs
        self.state, self.full_graph, self.graph_outputs = None, None, None

    # ---- the stages (NeMo's methods, on self.state) ----
    def _before_outer_loop(self):
        s = self.state
        s.batched_hyps.clear_()
        s.decoder_state.fill_(0.0)
        s.labels.fill_(BLANK)                                # <SOS> is blank
        s.scores.fill_(0.0)
        for t in (s.time_indices, s.safe_time_indices, s.time_indices_current_labels):
            t.fill_(0)
        torch.sub(s.encoder_output_length, 1, out=s.last_timesteps)
        torch.greater(s.encoder_output_length, 0, out=s.active_mask)
        torch.any(s.active_mask, out=s.active_mask_any)

    def _joint(self):
        s = self.state
        enc = s.encoder_output_projected[s.batch_indices, s.safe_time_indices]
        return torch.tanh(enc + s.decoder_output) @ self.w_joint

    def _before_inner_loop_get_decoder_output(self):
        s = self.state
        s.decoder_state.copy_(torch.tanh(self.embed[s.labels] + s.decoder_state @ self.w_pred))
        s.decoder_output.copy_(s.decoder_state)

    def _before_inner_loop_get_joint_output(self):
        s = self.state
        torch.max(self._joint(), dim=-1, out=(s.scores, s.labels))
        torch.eq(s.labels, BLANK, out=s.blank_mask)
        s.time_indices_current_labels.copy_(s.time_indices)
        self._advance(s)

    def _inner_loop_code(self):
        s = self.state
        torch.where(s.advance_mask, s.time_indices, s.time_indices_current_labels, out=s.time_indices_current_labels)
        more_scores, more_labels = self._joint().max(-1)
        torch.where(s.advance_mask, more_labels, s.labels, out=s.labels)
        torch.where(s.advance_mask, more_scores, s.scores, out=s.scores)
        torch.eq(s.labels, BLANK, out=s.blank_mask)
        self._advance(s)

    @staticmethod
    def _advance(s):
        s.time_indices.add_(s.blank_mask)
        torch.minimum(s.time_indices, s.last_timesteps, out=s.safe_time_indices)
        torch.less(s.time_indices, s.encoder_output_length, out=s.active_mask)
        torch.logical_and(s.active_mask, s.blank_mask, out=s.advance_mask)
        torch.any(s.advance_mask, out=s.advance_mask_any)

    def _after_inner_loop(self):
        s, hyps = self.state, self.state.batched_hyps
        hyps.add_results_masked_no_checks_(s.active_mask, s.labels, s.time_indices_current_labels, s.scores)
        force_blank = s.active_mask & (s.labels != BLANK) & (hyps.last_timestamp_lasts >= MAX_SYMBOLS) \
            & (hyps.last_timestamp == s.time_indices)
        s.time_indices.add_(force_blank)
        torch.minimum(s.time_indices, s.last_timesteps, out=s.safe_time_indices)
        torch.less(s.time_indices, s.encoder_output_length, out=s.active_mask)
        torch.any(s.active_mask, out=s.active_mask_any)

    # ---- the two implementations ----
    def _full_graph_compile(self):
        def full_graph():
            self._before_outer_loop()
            for _ in range(self.state.max_time * MAX_SYMBOLS + 1):   # while active_mask_any (conditional node)
                self._before_inner_loop_get_decoder_output()
                self._before_inner_loop_get_joint_output()
                for _ in range(self.state.max_time):                 # while advance_mask_any (conditional node)
                    self._inner_loop_code()
                self._after_inner_loop()
            h = self.state.batched_hyps
            return (h.transcript, h.timestamps, h.current_lengths, h.scores)

        self.full_graph, self.graph_outputs = capture(
            full_graph, device=self.device, warmups=0, owner="GreedyBatchedRNNTLoopLabelsComputer",
            static={"encoder_output_projected": self.state.encoder_output_projected,
                    "encoder_output_length": self.state.encoder_output_length})

    def loop_labels_cuda_graphs(self, encoder_output, encoder_output_length):
        batch_size, max_time, _ = encoder_output.shape
        if self.state is None:                                        # _graph_reinitialize
            self.state = LoopLabelsState(batch_size, max(max_time, INITIAL_MAX_TIME), self.device)
            self._full_graph_compile()
        self.state.encoder_output_projected[:batch_size, :max_time].copy_(encoder_output)
        self.state.encoder_output_length[:batch_size].copy_(encoder_output_length)
        transcript, timestamps, current_lengths, scores = replay(self.full_graph, self.graph_outputs)
        # returns self.state.batched_hyps: the graph's static buffers themselves
        return types.SimpleNamespace(transcript=transcript, timestamps=timestamps,
                                     current_lengths=current_lengths, scores=scores)

    def loop_labels_torch(self, encoder_output, encoder_output_length):
        batch_size, max_time, _ = encoder_output.shape
        self.state = LoopLabelsState(batch_size, max(max_time, INITIAL_MAX_TIME), self.device)   # fresh buffers
        self.state.encoder_output_projected[:, :max_time].copy_(encoder_output)
        self.state.encoder_output_length.copy_(encoder_output_length)
        self._before_outer_loop()
        while self.state.active_mask_any.item():
            self._before_inner_loop_get_decoder_output()
            self._before_inner_loop_get_joint_output()
            while self.state.advance_mask_any.item():
                self._inner_loop_code()
            self._after_inner_loop()
        return self.state.batched_hyps

    def __call__(self, x, out_len):
        if self.use_cuda_graphs:
            return self.loop_labels_cuda_graphs(x, out_len)
        return self.loop_labels_torch(x, out_len)


def run(variant: str, device: str = "cpu"):
    gen = generator(12808)
    embed = randn(VOCAB + 1, HIDDEN, gen=gen, device=device)
    embed[BLANK] = 0.0                                                # blank-as-pad embedding
    w_joint = randn(HIDDEN, VOCAB + 1, gen=gen, device=device)
    w_joint[:, BLANK] += 1.0                                          # blanks are common, as in real models
    weights = (embed, randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5), w_joint)
    batches = [(randn(BATCH, TIME, HIDDEN, gen=gen, device=device, scale=1.5),
                torch.tensor([[5, 3, 4], [4, 5, 2], [3, 4, 5]][b], device=device)) for b in range(NUM_BATCHES)]

    def transcribe(use_cuda_graph_decoder: bool):
        decoding_computer = GreedyBatchedRNNTLoopLabelsComputer(weights, device, use_cuda_graph_decoder)
        all_hypotheses = []
        for x, out_len in batches:
            batched_hyps = decoding_computer(x, out_len)
            hyps = batched_hyps_to_hypotheses(batched_hyps, x.shape[0], variant)
            for hyp in hyps:                                          # decode_hypothesis: text right away
                hyp.text = " ".join(str(t) for t in hyp.y_sequence.tolist())
            all_hypotheses.extend(hyps)
        return [t for hyp in all_hypotheses for t in (hyp.y_sequence, hyp.timestamp)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: transcribe(True), lambda: transcribe(False))
