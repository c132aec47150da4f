"""Label-looping RNNT decoding graphs captured inside the trainer's bf16 autocast read autocast's cached weight casts, which are freed when the step ends.

Upstream: https://github.com/NVIDIA/NeMo/pull/14184 ("Fix ASR decoding issues with CUDA graphs in training",
commit f72a99fcf4, 2025-08-06), completing https://github.com/NVIDIA/NeMo/pull/12938 ("Fix Transducer Decoding
with CUDA Graphs in DDP with Mixed Precision", commit 1bd626d93c, 2025-04-22), which did the same for DDP only.
Symptom: RNNT/TDT greedy decoding with CUDA graphs under Lightning ``precision="bf16-mixed"``: garbage
validation hypotheses (NeMo-Speech#10299: val RNNT WER "all over the place" while CTC WER is fine; #12938's test
asserts val WER <= 0.1 with ``trainer.validate``), and crashes "when trying to call ``.predict`` twice" (#14184).
The maintainers only wrote "incorrect behavior" with mixed precision; the mechanism below is read from the code.
Mechanism: Lightning runs every predict/validation step inside ``torch.autocast`` (``MixedPrecision
.forward_context``). ``cached_cast`` (aten/src/ATen/autocast_mode.cpp) keeps the bf16 cast
of every fp32 leaf that requires grad (the parameters of a trainable model) in ``cached_casts`` until the
outermost autocast region exits, in 2025 also under ``torch.inference_mode`` (only PyTorch #165068, merged in
December 2025, stopped caching there). ``GreedyBatchedLabelLoopingComputerBase.__call__`` (transducer_decoding/
label_looping_base.py) ran ``cuda_graphs_impl`` inside the caller's autocast (only DDP got
``autocast(enabled=False)`` from #12938). There ``_graph_reinitialize`` runs ``decoder.predict`` and
``joint.project_prednet`` eagerly and ``_warmup_for_cuda_graphs`` runs every stage (``joint_after_projection``)
before ``_partial_graphs_compile`` captures: every weight the graphs use is already in the cache, so the
captured GEMMs read the cached bf16 copies by address and no cast kernel is recorded. The step ends, the cache is
cleared, the copies are freed; every later replay reads released blocks: reused memory (garbage WER) or, if not
yet reused, the weights as they were at capture. ``on_predict_epoch_start`` only enables graphs if they are off,
so a second ``trainer.predict`` (here after loading another checkpoint in place) replays the first run's graphs
on those blocks. ``transcribe()`` freezes the modules (``requires_grad=False``: nothing cached); eager decoding
re-casts inside the live region.
Doctor: dangling-reference, at ``__call__`` (it runs capture and replay inside the caller's autocast region,
whose weight-cast cache owns the bf16 copies the captured GEMMs read; the region's exit frees them).
Fix (upstream): ``__call__`` always wraps ``cuda_graphs_impl`` in ``torch.amp.autocast(enabled=False)``:
reinit, warmup, capture and replay use the fp32 parameters themselves (persistent, updated in place);
``cuda_graphs_impl`` casts the encoder output to the parameters' dtype; ``ASRModel.on_predict_epoch_start`` (and
val/test) calls ``maybe_enable_cuda_graphs(force_reinit=True)`` to recapture at each run.
Modelled: autocast and its cache are modelled explicitly (``autocast``, ``cached_cast``, ``linear``) with the
rules before PyTorch #165068, because the PyTorch here no longer caches under ``inference_mode``; only ``linear`` is
an autocast op (embedding, add, relu, hardtanh keep their input dtype, as in torch). NO_WHILE_LOOPS mode (the
four partial graphs with host loops; conditional nodes are not emulated); no LM, alignments, confidence or
``prev_batched_state``; the LSTM prediction network as a one-layer hard-tanh RNN; encoder left out (batches are
encoder outputs). Weights and encoder outputs are small integers, so bf16 eager and the fp32 fixed graphs give
the same labels (hypotheses: labels, timestamps, lengths are compared; bf16 scores are not). The workload is the
``.predict``-twice path: one trainer predicts with a checkpoint, then with a later one of a joint-only
fine-tuning (loaded in place; same prediction network, so the graphs' precomputed after-<SOS> state stays right
and only the casts the GEMMs read go stale). The emulation (``on_freed="reuse"``) shows the not-yet-reused outcome:
the replays read the first checkpoint's freed casts. On CUDA the allocator may instead have handed those blocks
on (garbage; also within one run, as in the WER reports): wrong either way. Without the cache (a frozen model),
the same persisting graphs decode right.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/14184"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "__call__"
SYMPTOM = "bf16-mixed predict/val with graphed RNNT decoding replays GEMMs on freed autocast weight casts: wrong hyps"

VOCAB, ENC_DIM, PRED_HIDDEN, JOINT_HIDDEN = 4, 4, 4, 4
BLANK = VOCAB                                   # blank is the last class (blank-as-pad)
MAX_SYMBOLS, INITIAL_MAX_TIME = 2, 6
BATCH, TIME, BATCHES_PER_RUN = 3, 5, 2
LOWER = torch.bfloat16                          # trainer precision "bf16-mixed"


# --- torch.autocast and aten/src/ATen/autocast_mode.cpp (PyTorch <= 2.9) ------------------------------
class _AutocastState:
    enabled = False
    nesting = 0                                 # autocast_increment_nesting / autocast_decrement_nesting
    cached_casts: dict = {}                     # TensorImpl* -> (source, bf16 cast); torch keeps a weakref


def is_autocast_enabled() -> bool:
    return _AutocastState.enabled


class autocast:
    """``torch.autocast(device_type, dtype=bfloat16, enabled=...)`` with ``cache_enabled=True``."""

    def __init__(self, device_type, dtype=LOWER, enabled=True):
        self.device_type, self.fast_dtype, self._enabled = device_type, dtype, enabled

    def __enter__(self):
        self.prev = _AutocastState.enabled
        _AutocastState.enabled = self._enabled
        _AutocastState.nesting += 1
        return self

    def __exit__(self, *exc):
        _AutocastState.enabled = self.prev
        _AutocastState.nesting -= 1
        # "Drop the cache when we exit to a nesting level that's outside any instance of autocast."
        if _AutocastState.nesting == 0:
            _AutocastState.cached_casts.clear()
        return False


def cached_cast(arg):
    """``at::autocast::cached_cast`` to the lower precision: fp32 leaves that require grad are cast once per
    outermost autocast region (no ``InferenceMode`` exclusion before PyTorch #165068, December 2025)."""
    if arg is None or not arg.is_floating_point() or arg.dtype == LOWER:
        return arg
    can_try_cache = arg.dtype == torch.float32 and arg.requires_grad and arg.is_leaf and arg._base is None
    if can_try_cache:
        hit = _AutocastState.cached_casts.get(id(arg))
        if hit is not None and hit[0] is arg:
            return hit[1]
        casted = arg.to(LOWER)
        _AutocastState.cached_casts[id(arg)] = (arg, casted)
        return casted
    return arg.to(LOWER)


def linear(x, weight, bias=None):
    """``aten::linear`` as dispatched through ``AutocastCUDA`` (lower_precision_fp policy)."""
    if is_autocast_enabled():
        return F.linear(cached_cast(x), cached_cast(weight), cached_cast(bias))
    return F.linear(x, weight, bias)


def _int_weights(gen, *shape, low=-1, high=2):
    return torch.randint(low, high, shape, generator=gen).float()


# --- nemo/collections/asr/modules/rnnt.py --------------------------------------------------------------
class RNNTDecoder(nn.Module):
    """Prediction network (blank-as-pad embedding + recurrent layer)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(VOCAB + 1, PRED_HIDDEN))
        self.w_ih = nn.Parameter(torch.zeros(PRED_HIDDEN, PRED_HIDDEN))
        self.w_hh = nn.Parameter(torch.zeros(PRED_HIDDEN, PRED_HIDDEN))
        self.b = nn.Parameter(torch.zeros(PRED_HIDDEN))

    def initialize_state(self, y: torch.Tensor):
        return [torch.zeros(1, y.shape[0], PRED_HIDDEN, dtype=y.dtype, device=y.device)]

    def predict(self, y, state, add_sos=False, batch_size=None):
        emb = F.embedding(y, self.embed, padding_idx=BLANK)             # [B, 1, H]; not an autocast op
        h = F.hardtanh(linear(emb, self.w_ih) + linear(state[0].transpose(0, 1), self.w_hh, self.b))
        return h, [h.transpose(0, 1)]

    def batch_replace_states_all(self, src_states, dst_states):
        dst_states[0].copy_(src_states[0])

    def batch_replace_states_mask(self, src_states, dst_states, mask):
        torch.where(mask.unsqueeze(0).unsqueeze(-1), src_states[0], dst_states[0], out=dst_states[0])


class RNNTJoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(ENC_DIM, JOINT_HIDDEN)
        self.pred = nn.Linear(PRED_HIDDEN, JOINT_HIDDEN)
        self.joint_net = nn.Sequential(nn.ReLU(), nn.Linear(JOINT_HIDDEN, VOCAB + 1))
        self.num_classes_with_blank = VOCAB + 1

    def project_encoder(self, encoder_output):
        return linear(encoder_output, self.enc.weight, self.enc.bias)

    def project_prednet(self, prednet_output):
        return linear(prednet_output, self.pred.weight, self.pred.bias)

    def joint_after_projection(self, f, g):
        inp = torch.relu(f.unsqueeze(2) + g.unsqueeze(1))
        out = self.joint_net[1]
        return linear(inp, out.weight, out.bias)


# --- nemo/collections/asr/parts/utils/rnnt_utils.py ----------------------------------------------------
class BatchedHyps:
    def __init__(self, batch_size, init_length, device, float_dtype):
        z = lambda *s: torch.zeros(s, dtype=torch.long, device=device)  # noqa: E731
        self.current_lengths, self.transcript, self.timestamps = z(batch_size), z(batch_size, init_length), \
            z(batch_size, init_length)
        self.scores = torch.zeros(batch_size, dtype=float_dtype, device=device)
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

    def hypotheses(self, batch_size):
        """``batched_hyps_to_hypotheses`` (y_sequence, timestamp per utterance, cloned), -1 past each length."""
        width = TIME * MAX_SYMBOLS
        past = torch.arange(width, device=self.transcript.device)[None, :] >= self.current_lengths[:batch_size, None]
        return [self.transcript[:batch_size, :width].masked_fill(past, -1),
                self.timestamps[:batch_size, :width].masked_fill(past, -1), self.current_lengths[:batch_size].clone()]


# --- transducer_decoding/rnnt_label_looping.py ---------------------------------------------------------
class LabelLoopingState:
    def __init__(self, batch_size, max_time, encoder_dim, device, float_dtype):
        self.device, self.float_dtype, self.batch_size, self.max_time = device, float_dtype, batch_size, max_time
        self.encoder_output_projected = torch.zeros(batch_size, max_time, encoder_dim, dtype=float_dtype,
                                                    device=device)
        self.encoder_output_length = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.labels = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.scores = torch.zeros(batch_size, dtype=float_dtype, device=device)
        self.batch_indices = torch.arange(batch_size, dtype=torch.long, device=device)
        self.time_indices = torch.zeros_like(self.batch_indices)
        self.safe_time_indices = torch.zeros_like(self.batch_indices)
        self.time_indices_current_labels = torch.zeros_like(self.batch_indices)
        self.last_timesteps = torch.zeros_like(self.batch_indices)
        self.active_mask = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.advance_mask = torch.zeros_like(self.active_mask)
        self.blank_mask = torch.zeros_like(self.active_mask)
        self.active_mask_any = torch.tensor(True, device=device)
        self.advance_mask_any = torch.tensor(True, device=device)
        self.batched_hyps = BatchedHyps(batch_size, max_time * MAX_SYMBOLS, device, float_dtype)

    def need_reinit(self, encoder_output_projected):
        return self.batch_size < encoder_output_projected.shape[0] or self.max_time < encoder_output_projected.shape[1]


class SeparateGraphsLabelLooping:
    before_outer_loop = before_inner_loop = inner_loop_code = after_inner_loop = None


class GreedyBatchedLabelLoopingComputerBase:
    """transducer_decoding/label_looping_base.py"""

    def maybe_enable_cuda_graphs(self) -> bool:
        if self.cuda_graphs_mode is not None:
            return False                        # CUDA graphs are already enabled: state (and graphs) kept
        self.cuda_graphs_mode = "no_while_loops" if self.allow_cuda_graphs else None
        self.reset_cuda_graphs_state()
        return self.cuda_graphs_mode is not None

    def disable_cuda_graphs(self) -> bool:
        if self.cuda_graphs_mode is None:
            return False
        self.cuda_graphs_mode = None
        self.reset_cuda_graphs_state()
        return True

    def __call__(self, x, out_len, variant):
        if self.cuda_graphs_mode is not None:            # upstream also requires x.device.type == "cuda"
            if variant == "fix":
                # disable CUDA graphs if Mixed Precision is used due to incorrect behavior (#14184)
                ctx = autocast(device_type=x.device.type, enabled=False)
            else:
                is_ddp = False                           # single process: #12938's guard does not apply
                ctx = autocast(device_type=x.device.type, enabled=False) if is_ddp else _NullContext()
            with ctx:
                return self.cuda_graphs_impl(encoder_output=x, encoder_output_length=out_len, variant=variant)
        return self.torch_impl(encoder_output=x, encoder_output_length=out_len)


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class GreedyBatchedRNNTLabelLoopingComputer(GreedyBatchedLabelLoopingComputerBase):
    def __init__(self, decoder, joint, allow_cuda_graphs=True):
        self.decoder, self.joint, self._SOS = decoder, joint, BLANK
        self.max_symbols, self.allow_cuda_graphs = MAX_SYMBOLS, allow_cuda_graphs
        self.state = self.separate_graphs = self.graph_flags = None
        self.cuda_graphs_mode = None
        self.maybe_enable_cuda_graphs()

    def reset_cuda_graphs_state(self):
        self.state = self.separate_graphs = self.graph_flags = None

    # ---- pure PyTorch implementation (no graphs) ----
    def torch_impl(self, encoder_output, encoder_output_length):
        batch_size, max_time, _ = encoder_output.shape
        device = encoder_output.device
        encoder_output_projected = self.joint.project_encoder(encoder_output)
        float_dtype = encoder_output_projected.dtype
        batched_hyps = BatchedHyps(batch_size, max_time * self.max_symbols, device, float_dtype)
        batch_indices = torch.arange(batch_size, dtype=torch.long, device=device)
        last_timesteps = torch.maximum(encoder_output_length - 1, torch.zeros_like(encoder_output_length))
        time_indices = torch.zeros_like(batch_indices)
        safe_time_indices = torch.minimum(time_indices, last_timesteps)
        time_indices_current_labels = torch.zeros_like(time_indices)
        active_mask = time_indices < encoder_output_length
        advance_mask = torch.empty_like(active_mask)
        state = self.decoder.initialize_state(encoder_output_projected)
        labels = torch.full_like(batch_indices, fill_value=self._SOS)
        decoder_output, state = self.decoder.predict(labels.unsqueeze(1), state, add_sos=False, batch_size=batch_size)
        decoder_output = self.joint.project_prednet(decoder_output)
        while active_mask.any():
            logits = self.joint.joint_after_projection(
                encoder_output_projected[batch_indices, safe_time_indices].unsqueeze(1), decoder_output
            ).squeeze(1).squeeze(1)
            scores, labels = logits.max(-1)
            blank_mask = labels == self._SOS
            time_indices_current_labels.copy_(time_indices)
            time_indices += blank_mask
            torch.minimum(time_indices, last_timesteps, out=safe_time_indices)
            torch.less(time_indices, encoder_output_length, out=active_mask)
            torch.logical_and(active_mask, blank_mask, out=advance_mask)
            while advance_mask.any():
                torch.where(advance_mask, time_indices, time_indices_current_labels, out=time_indices_current_labels)
                logits = self.joint.joint_after_projection(
                    encoder_output_projected[batch_indices, safe_time_indices].unsqueeze(1), decoder_output
                ).squeeze(1).squeeze(1)
                more_scores, more_labels = logits.max(dim=-1)
                torch.where(advance_mask, more_labels, labels, out=labels)
                torch.where(advance_mask, more_scores, scores, out=scores)
                blank_mask = labels == self._SOS
                time_indices += blank_mask
                torch.minimum(time_indices, last_timesteps, out=safe_time_indices)
                torch.less(time_indices, encoder_output_length, out=active_mask)
                torch.logical_and(active_mask, blank_mask, out=advance_mask)
            batched_hyps.add_results_masked_no_checks_(active_mask, labels, time_indices_current_labels, scores)
            prev_state, prev_decoder_output = state, decoder_output
            decoder_output, state = self.decoder.predict(labels.unsqueeze(1), state, add_sos=False,
                                                         batch_size=batch_size)
            decoder_output = self.joint.project_prednet(decoder_output)
            self.decoder.batch_replace_states_mask(src_states=prev_state, dst_states=state, mask=~active_mask)
            torch.where(active_mask.unsqueeze(-1).unsqueeze(-1), decoder_output, prev_decoder_output,
                        out=decoder_output)
            force_blank_mask = active_mask & (labels != self._SOS) & \
                (batched_hyps.last_timestamp_lasts >= self.max_symbols) & (batched_hyps.last_timestamp == time_indices)
            time_indices += force_blank_mask
            torch.minimum(time_indices, last_timesteps, out=safe_time_indices)
            torch.less(time_indices, encoder_output_length, out=active_mask)
        return batched_hyps

    # ---- implementation with CUDA graphs ----
    def cuda_graphs_impl(self, encoder_output, encoder_output_length, variant):
        # do not recalculate joint projection, project only once
        encoder_output = self.joint.project_encoder(encoder_output)
        current_batch_size, current_max_time = encoder_output.shape[0], encoder_output.shape[1]
        if is_autocast_enabled():
            encoder_output = encoder_output.to(LOWER)            # torch.get_autocast_gpu_dtype()
        elif variant == "fix":
            # since autocast could be enabled outside and disallowed here, cast to dtype of params (#14184)
            encoder_output = encoder_output.to(next(self.joint.parameters()).dtype)
        if self.state is None or self.state.need_reinit(encoder_output):
            self._graph_reinitialize(encoder_output, encoder_output_length)
        self.state.encoder_output_projected[:current_batch_size, :current_max_time, ...].copy_(encoder_output)
        self.state.encoder_output_length[: encoder_output_length.shape[0]].copy_(encoder_output_length)
        self.state.encoder_output_length[current_batch_size:].fill_(0)
        self._init_decoding_state()
        g = self.separate_graphs
        active_any = replay(g.before_outer_loop, self.graph_flags["before_outer_loop"])
        while active_any.item():
            advance_any = replay(g.before_inner_loop, self.graph_flags["before_inner_loop"])
            while advance_any.item():
                advance_any = replay(g.inner_loop_code, self.graph_flags["inner_loop_code"])
            active_any = replay(g.after_inner_loop, self.graph_flags["after_inner_loop"])
        return self.state.batched_hyps

    def _graph_reinitialize(self, encoder_output_projected, encoder_output_length):
        batch_size, max_time, encoder_dim = encoder_output_projected.shape
        self.state = LabelLoopingState(batch_size, max(max_time, INITIAL_MAX_TIME), encoder_dim,
                                       encoder_output_projected.device, encoder_output_projected.dtype)
        # init decoder state (eager: under autocast this caches the prediction network's and pred's casts)
        self.state.labels.fill_(self._SOS)
        decoder_output, new_state = self.decoder.predict(
            self.state.labels.unsqueeze(1), self.decoder.initialize_state(self.state.encoder_output_projected),
            add_sos=False, batch_size=self.state.batch_size)
        self.state.decoder_state_after_sos = new_state
        self.state.decoder_state = self.decoder.initialize_state(encoder_output_projected)
        self.decoder.batch_replace_states_all(src_states=self.state.decoder_state_after_sos,
                                              dst_states=self.state.decoder_state)
        self.state.decoder_output_after_sos = self.joint.project_prednet(decoder_output)
        self.state.decoder_output = self.state.decoder_output_after_sos.clone()
        self._warmup_for_cuda_graphs()
        self._partial_graphs_compile()

    def _warmup_for_cuda_graphs(self):
        """Warmup before compiling CUDA graphs (#12938; 3 runs outside DDP; a side stream upstream)."""
        self.state.encoder_output_projected.fill_(0.0)
        self.state.encoder_output_length.fill_(1)
        for _ in range(3):
            with events.warmup():
                self._before_outer_loop()
                self._before_inner_loop_get_joint_output()
                self._inner_loop_step_find_next_non_blank()
                self._after_inner_loop_step()
        self.state.encoder_output_length.fill_(0)

    def _partial_graphs_compile(self):
        """Compile decoding by parts (upstream: each under torch.inference_mode() on a fresh stream)."""
        s = self.state
        static = {"encoder_output_projected": s.encoder_output_projected,
                  "encoder_output_length": s.encoder_output_length}
        carried = {"labels": s.labels, "scores": s.scores, "time_indices": s.time_indices,
                   "safe_time_indices": s.safe_time_indices, "last_timesteps": s.last_timesteps,
                   "time_indices_current_labels": s.time_indices_current_labels, "active_mask": s.active_mask,
                   "advance_mask": s.advance_mask, "blank_mask": s.blank_mask, "decoder_state": s.decoder_state[0],
                   "decoder_output": s.decoder_output, "transcript": s.batched_hyps.transcript,
                   "timestamps": s.batched_hyps.timestamps, "current_lengths": s.batched_hyps.current_lengths,
                   "hyps_scores": s.batched_hyps.scores, "last_timestamp": s.batched_hyps.last_timestamp,
                   "last_timestamp_lasts": s.batched_hyps.last_timestamp_lasts}
        self.separate_graphs, self.graph_flags = SeparateGraphsLabelLooping(), {}
        stages = {"before_outer_loop": (self._before_outer_loop, s.active_mask_any),
                  "before_inner_loop": (self._before_inner_loop_get_joint_output, s.advance_mask_any),
                  "inner_loop_code": (self._inner_loop_step_find_next_non_blank, s.advance_mask_any),
                  "after_inner_loop": (self._after_inner_loop_step, s.active_mask_any)}
        for name, (stage, flag) in stages.items():
            def fn(stage=stage, flag=flag):
                stage()
                return flag
            g, out = capture(fn, device=str(s.device), warmups=0, name=name, on_freed="reuse",
                             owner="GreedyBatchedRNNTLabelLoopingComputer", static=static, state=carried)
            setattr(self.separate_graphs, name, g)
            self.graph_flags[name] = out

    def _init_decoding_state(self):
        self.state.labels.fill_(self._SOS)
        self.decoder.batch_replace_states_all(src_states=self.state.decoder_state_after_sos,
                                              dst_states=self.state.decoder_state)
        self.state.decoder_output.copy_(self.state.decoder_output_after_sos)

    def _before_outer_loop(self):
        s = self.state
        s.batched_hyps.clear_()
        s.scores.fill_(0.0)
        s.time_indices.fill_(0)
        s.safe_time_indices.fill_(0)
        s.time_indices_current_labels.fill_(0)
        torch.sub(s.encoder_output_length, 1, out=s.last_timesteps)
        torch.greater(s.encoder_output_length, 0, out=s.active_mask)
        torch.any(s.active_mask, out=s.active_mask_any)

    def _joint_logits(self):
        s = self.state
        return self.joint.joint_after_projection(
            s.encoder_output_projected[s.batch_indices, s.safe_time_indices].unsqueeze(1), s.decoder_output
        ).squeeze(1).squeeze(1)

    def _before_inner_loop_get_joint_output(self):
        s = self.state
        torch.max(self._joint_logits(), dim=-1, out=(s.scores, s.labels))
        torch.eq(s.labels, self._SOS, out=s.blank_mask)
        s.time_indices_current_labels.copy_(s.time_indices)
        s.time_indices.add_(s.blank_mask)
        torch.minimum(s.time_indices, s.last_timesteps, out=s.safe_time_indices)
        torch.less(s.time_indices, s.encoder_output_length, out=s.active_mask)
        torch.logical_and(s.active_mask, s.blank_mask, out=s.advance_mask)
        torch.any(s.advance_mask, out=s.advance_mask_any)

    def _inner_loop_step_find_next_non_blank(self):
        s = self.state
        torch.where(s.advance_mask, s.time_indices, s.time_indices_current_labels, out=s.time_indices_current_labels)
        more_scores, more_labels = self._joint_logits().max(-1)
        torch.where(s.advance_mask, more_labels, s.labels, out=s.labels)
        torch.where(s.advance_mask, more_scores, s.scores, out=s.scores)
        torch.eq(s.labels, self._SOS, out=s.blank_mask)
        s.time_indices.add_(s.blank_mask)
        torch.minimum(s.time_indices, s.last_timesteps, out=s.safe_time_indices)
        torch.less(s.time_indices, s.encoder_output_length, out=s.active_mask)
        torch.logical_and(s.active_mask, s.blank_mask, out=s.advance_mask)
        torch.any(s.advance_mask, out=s.advance_mask_any)

    def _after_inner_loop_step(self):
        s = self.state
        # _after_inner_loop_store_labels
        s.batched_hyps.add_results_masked_no_checks_(s.active_mask, s.labels, s.time_indices_current_labels, s.scores)
        # _after_inner_loop_get_decoder_output
        decoder_output, new_state = self.decoder.predict(s.labels.unsqueeze(1), s.decoder_state, add_sos=False,
                                                         batch_size=s.batch_size)
        self.decoder.batch_replace_states_mask(src_states=new_state, dst_states=s.decoder_state, mask=s.active_mask)
        torch.where(s.active_mask.unsqueeze(-1).unsqueeze(-1), self.joint.project_prednet(decoder_output),
                    s.decoder_output, out=s.decoder_output)
        # _after_inner_loop_force_max_symbols
        hyps = s.batched_hyps
        force_blank_mask = s.active_mask & (s.labels != self._SOS) & \
            (hyps.last_timestamp_lasts >= self.max_symbols) & (hyps.last_timestamp == s.time_indices)
        s.time_indices.add_(force_blank_mask)
        torch.minimum(s.time_indices, s.last_timesteps, out=s.safe_time_indices)
        torch.less(s.time_indices, s.encoder_output_length, out=s.active_mask)
        torch.any(s.active_mask, out=s.active_mask_any)


# --- nemo/collections/asr/models (EncDecRNNTModel / ASRModel) and the Lightning trainer --------------------
class EncDecRNNTModel(nn.Module):
    def __init__(self, device, use_cuda_graph_decoder):
        super().__init__()
        self.decoder, self.joint = RNNTDecoder().to(device), RNNTJoint().to(device)
        self.decoding_computer = GreedyBatchedRNNTLabelLoopingComputer(self.decoder, self.joint,
                                                                       allow_cuda_graphs=use_cuda_graph_decoder)

    def maybe_enable_cuda_graphs(self, force_reinit=False):
        if force_reinit:
            self.decoding_computer.disable_cuda_graphs()
        return self.decoding_computer.maybe_enable_cuda_graphs()

    def on_predict_epoch_start(self, variant):
        # #14184: "Force re-enabling required due to issues with trainer and mixed precision."
        self.maybe_enable_cuda_graphs(force_reinit=(variant == "fix"))

    def predict_step(self, batch, variant):
        encoded, encoded_len = batch
        # GreedyBatchedRNNTInfer.forward: inference mode, [B, D, T] -> [B, T, D]
        with torch.inference_mode():
            x = encoded.transpose(1, 2)
            batched_hyps = self.decoding_computer(x, encoded_len, variant)
            return batched_hyps.hypotheses(x.shape[0])


class Trainer:
    """``lightning.pytorch.Trainer(precision="bf16-mixed")``: each predict step runs in its own autocast region."""

    def predict(self, model, dataloader, variant, device):
        model.on_predict_epoch_start(variant)
        outputs = []
        for batch in dataloader:
            with autocast(device_type=torch.device(device).type, dtype=LOWER):   # MixedPrecision.forward_context
                outputs += model.predict_step(batch, variant)
        return outputs


def checkpoint(seed):
    gen = generator(seed)
    ckpt = {"decoder.embed": _int_weights(gen, VOCAB + 1, PRED_HIDDEN),
            "decoder.w_ih": _int_weights(gen, PRED_HIDDEN, PRED_HIDDEN),
            "decoder.w_hh": _int_weights(gen, PRED_HIDDEN, PRED_HIDDEN),
            "decoder.b": _int_weights(gen, PRED_HIDDEN),
            "joint.enc.weight": _int_weights(gen, JOINT_HIDDEN, ENC_DIM),
            "joint.enc.bias": _int_weights(gen, JOINT_HIDDEN),
            "joint.pred.weight": _int_weights(gen, JOINT_HIDDEN, PRED_HIDDEN),
            "joint.pred.bias": _int_weights(gen, JOINT_HIDDEN),
            "joint.joint_net.1.weight": _int_weights(gen, VOCAB + 1, JOINT_HIDDEN),
            "joint.joint_net.1.bias": _int_weights(gen, VOCAB + 1, low=-2, high=1)}
    ckpt["decoder.embed"][BLANK] = 0.0                  # blank-as-pad embedding
    ckpt["joint.joint_net.1.bias"][BLANK] = 2.0         # blanks are common, as in trained models
    return ckpt


def run(variant: str, device: str = "cpu"):
    gen = generator(14184)
    lengths = ([5, 3, 4], [4, 5, 2])
    batches = [(torch.randint(-2, 3, (BATCH, ENC_DIM, TIME), generator=gen).float().to(device),
                torch.tensor(lengths[b], device=device)) for b in range(BATCHES_PER_RUN)]
    first, later = checkpoint(1), checkpoint(2)
    # the later checkpoint of a joint-only fine-tuning: same prediction network, new joint (so the graphs'
    # precomputed after-<SOS> decoder state stays right; only the weights the joint GEMMs read change)
    later = {k: (v if k.startswith("joint.") and "pred" not in k else first[k]) for k, v in later.items()}
    checkpoints = [{k: v.to(device) for k, v in ckpt.items()} for ckpt in (first, later)]

    def evaluate(use_cuda_graph_decoder: bool):
        model, trainer, outs = EncDecRNNTModel(device, use_cuda_graph_decoder), Trainer(), []
        for ckpt in checkpoints:                         # two checkpoints, one trainer: .predict twice
            model.load_state_dict(ckpt)                  # copies into the parameters in place
            outs += trainer.predict(model, batches, variant, device)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: evaluate(True), lambda: evaluate(False))
