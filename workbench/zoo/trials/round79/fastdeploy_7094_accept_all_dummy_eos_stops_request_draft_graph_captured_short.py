"""Accept-all capture warm-up accepts a dummy EOS draft, so the MTP graph for 8 tokens is recorded over 6.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/7094 ("fix cuda graph capture failure in CI test",
merged 2026-03-31, commit dd2aa10ed4051262bdfc173147804bec49ac7447).
Symptom: MTP speculative decoding with CUDA graphs (``draft_model_use_cudagraph``) fails at start-up capture now
and then (CI), depending on the tokens the draft model happens to propose for the dummy requests: "CUDA graph
capture failures due to token count mismatch in subsequent MTP decode steps" (the PR names no failing check).
Here the graph recorded for the
largest capture size covers one request fewer than it should, and every full-batch decode step replays it: the
last request's draft hidden state comes back as zeros, so its draft tokens are garbage (rejected, no speed-up).
Mechanism: ``GPUModelRunner.capture_model`` captures, for each capture size ``C`` (descending), a dummy run of
``C / (k + 1)`` requests with ``_dummy_run(..., accept_all_drafts=True)``: a dummy prefill, then decode steps in
which the target verifies with ``accept_all`` so that every request returns ``k + 1`` tokens and the MTP
proposer's decode step (captured by its ``CudaGraphPiecewiseBackend``, keyed for speculative decoding by
``real_bsz_to_captured_size[number of running requests]``) sees ``C`` tokens. The dummy requests' draft tokens
are whatever the draft model sampled (temperature 1) on the dummy prompt. In
``custom_ops/gpu_ops/speculate_decoding/verify_draft_tokens.cu::verify_draft_tokens`` the accept-all branch
emitted ``step_input_ids_now[i + 1]`` through ``VerifyContext::emit_token``, which treats an EOS id as a stop:
a dummy draft equal to EOS stops that request (``stop_flags`` set by ``unified_update_model_status``),
``draft_model_preprocess`` skips it (``seq_lens_this_time = 0``), and the proposer's capture step runs with
``B - 1`` requests. With 4 dummy requests and ``k = 1``, 3 running requests still map to capture size 8, so the
entry for 8 is captured while ``ids_remove_padding`` holds 6 tokens: its kernels are recorded for 6 rows and
its output buffer has 6 rows. Later a real step with 4 requests (8 tokens) replays that graph;
``model_output[:real_token_num]`` is 6 rows and ``eagle_gather_hidden_states`` (which walks the input rows and
pre-zeroes its output) leaves the 4th request's hidden state at zero. Eager runs the draft on all 8 tokens.
Doctor: undersized-buffer, at ``verify_draft_tokens`` (its accept-all branch lets a dummy EOS stop a capture
request, so the draft graph of capture size 8 is recorded over 6 token rows; every full-batch replay is asked to
serve 8 rows, more than were captured).
Fix (upstream): in the accept-all branch, an EOS draft token is replaced by a safe non-EOS id (5) before
``emit_token``, so no dummy request stops and each capture sees exactly its capture size.
Modelled: ``k = 1`` speculative token, 4 slots, capture sizes 2/4/8 tokens, one MTP step. Target and draft are
attention-free token+position models (the target runs eagerly: its graphs are captured before the verify and
are not affected); greedy verification (``verify_strategy`` GREEDY); the per-slot bookkeeping kernels
(``pre_process``, ``unified_update_model_status``, ``draft_model_preprocess/update/postprocess``) as host
loops; the draft's gathered hidden states and sampled tokens are indexed by slot instead of compacted; the
dummy draft sampling uses a seeded Gumbel draw per slot (``infer_seed``), the seeds chosen so that exactly one
of the four dummy requests draws EOS. The MTP head shares the main model's embedding and LM head (as upstream)
and mostly agrees with the target, so full-batch steps do reach 7-8 draft tokens. Observables: the draft tokens
and accept counts of each served step and the generated tokens (equal under greedy verification).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/7094"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "verify_draft_tokens"
SYMPTOM = ("a dummy EOS draft stops one capture request, the MTP graph for 8 tokens is recorded over 6, and "
           "full-batch replays give the last request a zero draft hidden state (garbage drafts)")

VOCAB, HIDDEN = 16, 8
NUM_SPECULATIVE_TOKENS = 1                        # k
MAX_DRAFT_TOKENS = NUM_SPECULATIVE_TOKENS + 1     # tokens per decoding request per step
MAX_NUM_SEQS = 4
MAX_CHUNK_TOKENS = 16                             # fd_config.get_max_chunk_tokens()
MAX_MODEL_LEN = 40
CUDAGRAPH_CAPTURE_SIZES = [8, 4, 2]               # tokens, descending (init_with_cudagrpah_size)
EOS_TOKEN_ID = 2
DUMMY_TOKEN_ID = 5
NUM_MODEL_STEPS = 1
TARGET_WEIGHT_SEED, MTP_WEIGHT_SEED = 70963, 70943


# --- fastdeploy/config.py -------------------------------------------------------------------------------------

def expand_bsz_map(real_bsz_to_captured_size):
    """Expand a sparse batch size -> capture size mapping into a dense one."""
    result, prev_bsz = {}, 0
    for curr_bsz, cap in sorted(real_bsz_to_captured_size.items()):
        for bsz in range(prev_bsz + 1, curr_bsz + 1):
            result[bsz] = cap
        prev_bsz = curr_bsz
    return result


class GraphOptimizationConfig:
    def __init__(self):
        self.cudagraph_capture_sizes = list(CUDAGRAPH_CAPTURE_SIZES)
        self.cudagraph_num_of_warmups = 1
        self.draft_model_use_cudagraph = True
        self.real_bsz_to_captured_size = expand_bsz_map(
            {int(c / (NUM_SPECULATIVE_TOKENS + 1)): c for c in self.cudagraph_capture_sizes})
        self.real_shape_to_captured_size = {}
        for end, start in zip(self.cudagraph_capture_sizes, self.cudagraph_capture_sizes[1:] + [0]):
            for bs in range(start, end):
                self.real_shape_to_captured_size[bs] = start if bs == start else end
        self.real_shape_to_captured_size[self.cudagraph_capture_sizes[0]] = self.cudagraph_capture_sizes[0]


# --- fastdeploy/model_executor/forward_meta.py ----------------------------------------------------------------

class ForwardMeta:
    def __init__(self, ids_remove_padding, num_tokens, batch_id_per_token, cu_seqlens_q, seq_lens_decoder,
                 seq_lens_this_time, step_use_cudagraph=False):
        self.ids_remove_padding = ids_remove_padding
        self.num_tokens = num_tokens      # ids_remove_padding.shape[0] (Paddle's copy_ gives it the step's size)
        self.batch_id_per_token, self.cu_seqlens_q = batch_id_per_token, cu_seqlens_q
        self.seq_lens_decoder, self.seq_lens_this_time = seq_lens_decoder, seq_lens_this_time
        self.step_use_cudagraph = step_use_cudagraph


# --- fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py ------------------------------

class ConcreteSizeEntry:
    """Record the concrete information corresponding to the current shape (num_tokens)."""

    def __init__(self, real_shape, runnable=None):
        self.real_shape, self.runnable = real_shape, runnable
        self.cuda_graph = None
        self.output_buffers = []


class CudaGraphPiecewiseBackend:
    """Manage the capture and replay of CUDA graphs (dynamic-graph mode, decode only)."""

    def __init__(self, graph_opt_config, runnable, device, static_buffers):
        self.graph_opt_config, self.device = graph_opt_config, device
        self.warm_up_size = graph_opt_config.cudagraph_num_of_warmups
        self.real_shape_to_captured_size = graph_opt_config.real_shape_to_captured_size
        self.real_bsz_to_captured_size = graph_opt_config.real_bsz_to_captured_size
        self.speculative_decoding = True
        self.static_buffers = static_buffers
        self.pool = graph_pool_handle(device)
        self.concrete_size_entries = {s: ConcreteSizeEntry(real_shape=s, runnable=runnable)
                                      for s in graph_opt_config.cudagraph_capture_sizes}

    def __call__(self, **kwargs):
        forward_meta: ForwardMeta = kwargs["forward_meta"]
        real_shape = forward_meta.num_tokens
        if self.speculative_decoding and all(self.real_bsz_to_captured_size.values()):
            num_running_requests = int((forward_meta.seq_lens_this_time.flatten() > 0).sum().item())
            real_shape = self.real_bsz_to_captured_size[num_running_requests]
        padding_real_shape = self.real_shape_to_captured_size[real_shape]
        entry = self.concrete_size_entries.get(padding_real_shape)
        assert entry is not None, f"real shape:{padding_real_shape} is not in cuda graph capture list."

        if entry.cuda_graph is None:
            assert real_shape == padding_real_shape, (f"real_shape:{real_shape} is not equal to padding_real_shape:"
                                                      f"{padding_real_shape} when capture new graph.")
            entry.cuda_graph, output = capture(
                lambda: entry.runnable(**kwargs), device=self.device, pool=self.pool, warmups=self.warm_up_size,
                name=f"MTP draft real shape {padding_real_shape}", owner="MTP CudaGraphPiecewiseBackend",
                static=self.static_buffers)
            entry.output_buffers = [output]

        num_tokens = forward_meta.num_tokens
        padded = None
        if num_tokens < padding_real_shape:     # rows past the step's tokens keep an earlier step's values
            padded = {"ids_remove_padding": self.static_buffers["ids_remove_padding"],
                      "target_hidden_states": self.static_buffers["target_hidden_states"]}
        return replay(entry.cuda_graph, entry.output_buffers[0], real=num_tokens, size=padding_real_shape,
                      padded=padded)


# --- models ---------------------------------------------------------------------------------------------------

class ErnieForCausalLM:
    """The target model (run eagerly here): a token + position model and its LM head."""

    def __init__(self, device):
        gen = generator(TARGET_WEIGHT_SEED)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_emb = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=1.5)

    def forward(self, ids, positions):
        return torch.tanh(self.embed_tokens[ids] + self.pos_emb[positions])

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class Ernie4_5_MTPForCausalLM:
    """The MTP draft head: the main model's (shared) token embedding and LM head, a projection of the target's
    hidden state, its own position table; forward goes through the graph backend when
    ``forward_meta.step_use_cudagraph`` (``@support_graph_optimization``)."""

    def __init__(self, graph_opt_config, main_model, device, static_buffers):
        gen = generator(MTP_WEIGHT_SEED)
        self.embed_tokens, self.lm_head = main_model.embed_tokens, main_model.lm_head   # sharing_model
        self.eh_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.15)
        # trained to predict one token further than the target at the same position
        self.pos_emb = main_model.pos_emb.roll(-1, 0) + randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.2)
        self.graph_opt_backend = CudaGraphPiecewiseBackend(graph_opt_config, self.forward, device, static_buffers)

    def __call__(self, ids_remove_padding, previous_hidden_states, forward_meta: ForwardMeta):
        if forward_meta.step_use_cudagraph:
            return self.graph_opt_backend(ids_remove_padding=ids_remove_padding,
                                          previous_hidden_states=previous_hidden_states, forward_meta=forward_meta)
        return self.forward(ids_remove_padding, previous_hidden_states, forward_meta)

    def forward(self, ids_remove_padding, previous_hidden_states, forward_meta: ForwardMeta):
        n = forward_meta.num_tokens                                   # the kernels' launch size
        tok = torch.arange(n, device=ids_remove_padding.device)
        batch_id = forward_meta.batch_id_per_token[:n].clamp_min(0)   # -1 (padding) rows: skipped by the kernels
        positions = forward_meta.seq_lens_decoder[batch_id] + tok - forward_meta.cu_seqlens_q[batch_id]
        h = (self.embed_tokens[ids_remove_padding[:n]] + previous_hidden_states[:n] @ self.eh_proj
             + self.pos_emb[positions])
        return torch.tanh(h)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- custom_ops/gpu_ops/speculate_decoding --------------------------------------------------------------------

def is_in_end(token, end_tokens):
    return token in end_tokens


class VerifyContext:
    def __init__(self, bid, end_tokens, max_dec_len, step_input_ids_now, cur_step_idx):
        self.bid, self.end_tokens, self.max_dec_len = bid, end_tokens, max_dec_len
        self.step_input_ids_now, self.cur_step_idx = step_input_ids_now, cur_step_idx
        self.step_output_ids, self.stopped = [], False

    def emit_token(self, pos, token):
        """Write one accepted token; returns True when this sequence should stop (EOS or max_dec_len)."""
        self.cur_step_idx += 1
        is_eos = is_in_end(token, self.end_tokens)
        max_len_hit = self.cur_step_idx >= self.max_dec_len[self.bid]
        if max_len_hit and not is_eos:
            token = self.end_tokens[0]
        self.step_output_ids.append(token)
        if is_eos or max_len_hit:
            self.stopped = True
            return True
        return False

    def emit_final_token(self, pos, token):
        self.cur_step_idx += 1
        is_eos = is_in_end(token, self.end_tokens)
        if self.cur_step_idx >= self.max_dec_len[self.bid] and not is_eos:
            token = self.end_tokens[0]
        self.step_output_ids.append(token)


def verify_draft_tokens(variant, step_input_ids, target_tokens, stop_flags, seq_lens_encoder, seq_lens_this_time,
                        end_tokens, max_dec_len, step_idx, accept_all):
    """GREEDY verification of each slot's draft tokens; returns (step_output_ids, stopped) per slot."""
    outputs = [([], False)] * MAX_NUM_SEQS
    for bid in range(MAX_NUM_SEQS):
        if seq_lens_this_time[bid] == 0 or stop_flags[bid]:
            continue
        ctx = VerifyContext(bid, end_tokens, max_dec_len, step_input_ids[bid], step_idx[bid])
        target_tokens_now = target_tokens[bid]
        i = 0
        while i < seq_lens_this_time[bid] - 1:
            if seq_lens_encoder[bid] != 0:
                break
            # Accept-all override (debug/warmup/CUDA graph capture)
            if accept_all:
                token = ctx.step_input_ids_now[i + 1]
                if variant == "fix" and is_in_end(token, end_tokens):
                    token = 5     # a safe non-EOS value: no stop_flags during the dummy run
                if ctx.emit_token(i, token):
                    break
                i += 1
                continue
            if target_tokens_now[i] == ctx.step_input_ids_now[i + 1]:
                if ctx.emit_token(i, ctx.step_input_ids_now[i + 1]):
                    break
                i += 1
            else:
                break  # reject
        if not ctx.stopped:
            ctx.emit_final_token(i, target_tokens_now[i])
        outputs[bid] = (ctx.step_output_ids, ctx.stopped)
    return outputs


def eagle_gather_hidden_states(model_output, cu_seqlens_q, seq_lens_this_time):
    """Each running request's last-token hidden state. Like the kernel, it walks the input rows it was given
    (``input.shape[0]``) and writes into a pre-zeroed output: a request whose last token is not among them keeps
    a zero row."""
    out = torch.zeros(MAX_NUM_SEQS, HIDDEN, device=model_output.device)
    input_token_num = model_output.shape[0]
    for b in range(MAX_NUM_SEQS):
        last_token_idx = cu_seqlens_q[b] + seq_lens_this_time[b] - 1
        if seq_lens_this_time[b] > 0 and last_token_idx < input_token_num:
            out[b] = model_output[last_token_idx]
    return out


# --- fastdeploy/spec_decode/mtp.py ----------------------------------------------------------------------------

class MTPProposer:
    def __init__(self, graph_opt_config, target, device):
        self.target, self.device = target, device
        self.draft_model_use_cudagraph = graph_opt_config.draft_model_use_cudagraph
        self.sampler = MTPSampler()
        self.model_inputs = {
            "ids_remove_padding": torch.zeros(MAX_CHUNK_TOKENS, dtype=torch.long, device=device),
            "batch_id_per_token": torch.full((MAX_CHUNK_TOKENS,), -1, dtype=torch.long, device=device),
            "cu_seqlens_q": torch.zeros(MAX_NUM_SEQS + 1, dtype=torch.long, device=device),
            "seq_lens_decoder": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
            "seq_lens_this_time_buffer": torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device),
            "target_hidden_states": torch.zeros(MAX_CHUNK_TOKENS, HIDDEN, device=device),
        }
        self.seq_lens_encoder = [0] * MAX_NUM_SEQS           # host copies of the draft's per-slot state
        self.seq_lens_this_time = [0] * MAX_NUM_SEQS
        self.seq_lens_decoder = [0] * MAX_NUM_SEQS
        self.cu_seqlens_q = [0] * (MAX_NUM_SEQS + 1)
        self.model = Ernie4_5_MTPForCausalLM(graph_opt_config, target.model, device, {
            k: self.model_inputs[k] for k in ("ids_remove_padding", "batch_id_per_token", "cu_seqlens_q",
                                              "seq_lens_decoder", "target_hidden_states")})

    def insert_prefill_inputs(self, idx, prompt_len):
        self.seq_lens_encoder[idx] = prompt_len

    def _prepare_inputs(self, full_hidden_states, step_tokens):
        """draft_model_preprocess + eagle_get_hidden_states: the draft's tokens and target hidden rows."""
        t = self.target
        ids, hidden_rows = [], []
        for tid in range(MAX_NUM_SEQS):
            for i in range(1, MAX_DRAFT_TOKENS):
                t.draft_tokens[tid][i] = -1
            should_skip = t.stop_flags[tid] or t.seq_lens_this_time[tid] == 0 \
                or t.step_idx[tid] + NUM_MODEL_STEPS >= t.max_dec_len[tid]
            if should_skip:
                self.seq_lens_this_time[tid] = self.seq_lens_decoder[tid] = self.seq_lens_encoder[tid] = 0
                continue
            first, n_in = step_tokens[tid]
            if self.seq_lens_encoder[tid] > 0:                 # prefill: prompt shifted by the first token
                prompt = t.token_ids_all[tid][:self.seq_lens_encoder[tid]]
                toks = prompt[1:] + [t.accept_tokens[tid][0]]
                self.seq_lens_decoder[tid] = 0
                rows = list(range(first, first + n_in))
            else:                                               # decode: the accepted tokens
                toks = list(t.accept_tokens[tid][:t.accept_num[tid]])
                self.seq_lens_decoder[tid] = t.seq_lens_decoder[tid] - t.accept_num[tid]
                rows = list(range(first, first + t.accept_num[tid]))
            self.seq_lens_this_time[tid] = len(toks)
            ids += toks
            hidden_rows += rows
        n = len(ids)
        self.cu_seqlens_q = [0]
        batch_ids = []
        for b in range(MAX_NUM_SEQS):
            batch_ids += [b] * self.seq_lens_this_time[b]
            self.cu_seqlens_q.append(self.cu_seqlens_q[-1] + self.seq_lens_this_time[b])
        mi, dev = self.model_inputs, self.device
        if n:
            mi["ids_remove_padding"][:n].copy_(torch.tensor(ids, device=dev))
            mi["batch_id_per_token"].fill_(-1)
            mi["batch_id_per_token"][:n].copy_(torch.tensor(batch_ids, device=dev))
            mi["target_hidden_states"][:n].copy_(full_hidden_states[torch.tensor(hidden_rows, device=dev)])
        mi["cu_seqlens_q"].copy_(torch.tensor(self.cu_seqlens_q, device=dev))
        mi["seq_lens_decoder"].copy_(torch.tensor(self.seq_lens_decoder, device=dev))
        mi["seq_lens_this_time_buffer"].copy_(torch.tensor(self.seq_lens_this_time, device=dev))
        return n

    def _propose(self, token_num, step_use_cudagraph):
        if token_num == 0:                                     # not_need_stop is False
            return
        mi, t = self.model_inputs, self.target
        forward_meta = ForwardMeta(
            ids_remove_padding=mi["ids_remove_padding"], num_tokens=token_num,
            batch_id_per_token=mi["batch_id_per_token"], cu_seqlens_q=mi["cu_seqlens_q"],
            seq_lens_decoder=mi["seq_lens_decoder"], seq_lens_this_time=mi["seq_lens_this_time_buffer"],
            step_use_cudagraph=step_use_cudagraph and self.draft_model_use_cudagraph)
        self.real_token_num = token_num                        # padding_cudagraph_inputs
        model_output = self.model(ids_remove_padding=mi["ids_remove_padding"],
                                  previous_hidden_states=mi["target_hidden_states"], forward_meta=forward_meta)
        if forward_meta.step_use_cudagraph:
            model_output = model_output[: self.real_token_num]
        hidden_states = eagle_gather_hidden_states(model_output, self.cu_seqlens_q, self.seq_lens_this_time)
        logits = self.model.compute_logits(hidden_states)
        sampled = self.sampler(logits, t.temperature, t.infer_seed, t.step_idx)
        for b in range(MAX_NUM_SEQS):                          # draft_model_update
            if self.seq_lens_this_time[b] > 0:
                t.draft_tokens[b][1] = sampled[b]
                self.seq_lens_encoder[b] = 0

    def _update_status(self):
        """draft_model_postprocess: the target's next seq_lens_this_time from its draft tokens."""
        t = self.target
        for b in range(MAX_NUM_SEQS):
            if t.stop_flags[b]:
                t.seq_lens_this_time[b] = 0
            else:
                t.seq_lens_this_time[b] = 1 + sum(1 for x in t.draft_tokens[b][1:] if x != -1)

    def run(self, full_hidden_states, step_tokens, step_use_cudagraph=False):
        token_num = self._prepare_inputs(full_hidden_states, step_tokens)
        self._propose(token_num, step_use_cudagraph)
        self._update_status()


class MTPSampler:
    """Greedy for temperature 0; otherwise a seeded Gumbel draw per slot (top-p 1)."""

    def __call__(self, logits, temperature, infer_seed, step_idx):
        out = []
        rows = logits.detach().to("cpu")
        for b in range(MAX_NUM_SEQS):
            if temperature[b] > 0:
                g = torch.Generator().manual_seed(1000 * infer_seed[b] + step_idx[b])
                u = torch.rand(VOCAB, generator=g).clamp(1e-9, 1 - 1e-9)
                out.append(int((rows[b] / temperature[b] - torch.log(-torch.log(u))).argmax()))
            else:
                out.append(int(rows[b].argmax()))
        return out


# --- fastdeploy/worker/gpu_model_runner.py --------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, variant, device, use_cudagraph):
        self.variant, self.device, self.use_cudagraph = variant, device, use_cudagraph
        self.graph_opt_config = GraphOptimizationConfig()
        self.model = ErnieForCausalLM(device)
        # share_inputs (per slot; host copies of the bookkeeping the update kernels keep on the device)
        self.token_ids_all = [[] for _ in range(MAX_NUM_SEQS)]
        self.seq_lens_encoder = [0] * MAX_NUM_SEQS
        self.seq_lens_decoder = [0] * MAX_NUM_SEQS
        self.seq_lens_this_time = [0] * MAX_NUM_SEQS
        self.step_idx = [0] * MAX_NUM_SEQS
        self.max_dec_len = [0] * MAX_NUM_SEQS
        self.stop_flags = [True] * MAX_NUM_SEQS
        self.temperature = [0.0] * MAX_NUM_SEQS
        self.infer_seed = list(range(MAX_NUM_SEQS))
        self.draft_tokens = [[-1] * MAX_DRAFT_TOKENS for _ in range(MAX_NUM_SEQS)]
        self.accept_tokens = [[] for _ in range(MAX_NUM_SEQS)]
        self.accept_num = [0] * MAX_NUM_SEQS
        self.eos_token_id = [EOS_TOKEN_ID]
        self.proposer = MTPProposer(self.graph_opt_config, self, device)

    def insert_request(self, idx, prompt, max_dec_len, temperature):
        self.token_ids_all[idx] = list(prompt)
        self.seq_lens_encoder[idx] = self.seq_lens_this_time[idx] = len(prompt)
        self.seq_lens_decoder[idx] = self.step_idx[idx] = 0
        self.max_dec_len[idx], self.temperature[idx] = max_dec_len, temperature
        self.stop_flags[idx] = False
        self.draft_tokens[idx] = [-1] * MAX_DRAFT_TOKENS
        self.proposer.insert_prefill_inputs(idx, len(prompt))

    def exist_prefill(self):
        return any(self.seq_lens_encoder[b] > 0 and self.seq_lens_this_time[b] > 0 for b in range(MAX_NUM_SEQS))

    def _prepare_inputs(self):
        """pre_process: the step's tokens without padding, their positions, and each slot's token range."""
        ids, positions, step_tokens = [], [], {}
        for b in range(MAX_NUM_SEQS):
            n = self.seq_lens_this_time[b]
            if n == 0:
                continue
            toks = (self.token_ids_all[b][:n] if self.seq_lens_encoder[b] > 0
                    else self.draft_tokens[b][:n])
            step_tokens[b] = (len(ids), n)
            ids += toks
            positions += [self.seq_lens_decoder[b] + i for i in range(n)]
        return ids, positions, step_tokens

    def _run_step(self, accept_all_drafts=False, is_dummy_run=False, in_capturing=False):
        ids, positions, step_tokens = self._prepare_inputs()
        if not ids:                                           # nothing running
            return
        step_use_cudagraph = self.use_cudagraph and not self.exist_prefill()     # only-decode batches
        if is_dummy_run:
            step_use_cudagraph = in_capturing and step_use_cudagraph
        dev = self.device
        hidden_states = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev))
        argmax = self.model.compute_logits(hidden_states).argmax(-1).tolist()
        target_tokens = [[] for _ in range(MAX_NUM_SEQS)]
        for b, (first, n) in step_tokens.items():
            prefill = self.seq_lens_encoder[b] > 0
            target_tokens[b] = argmax[first + n - 1:first + n] if prefill else argmax[first:first + n]
        # sampler: verify_draft_tokens
        outputs = verify_draft_tokens(self.variant, self.draft_tokens, target_tokens, self.stop_flags,
                                      self.seq_lens_encoder, self.seq_lens_this_time, self.eos_token_id,
                                      self.max_dec_len, self.step_idx, accept_all_drafts)
        # post_process: unified_update_model_status
        for b, (first, n) in step_tokens.items():
            out, stopped = outputs[b]
            self.accept_tokens[b], self.accept_num[b] = out, len(out)
            self.seq_lens_decoder[b] += n if self.seq_lens_encoder[b] > 0 else len(out)
            self.seq_lens_encoder[b] = 0
            self.step_idx[b] += len(out)
            self.token_ids_all[b] += out
            self.draft_tokens[b][0] = out[-1]
            if stopped or out[-1] in self.eos_token_id or self.step_idx[b] >= self.max_dec_len[b]:
                self.stop_flags[b] = True
        self.proposer.run(full_hidden_states=hidden_states, step_tokens=step_tokens,
                          step_use_cudagraph=step_use_cudagraph)

    def _dummy_run(self, num_tokens, batch_size, expected_decode_len, in_capturing, accept_all_drafts):
        max_dec_len = expected_decode_len + 1
        input_length = min(num_tokens // batch_size, MAX_MODEL_LEN - max_dec_len)
        for idx in range(batch_size):                 # _dummy_prefill_inputs + proposer.dummy_prefill_inputs
            self.insert_request(idx, [DUMMY_TOKEN_ID] * input_length, max_dec_len, temperature=1.0)
        while True:
            self._run_step(accept_all_drafts=accept_all_drafts, is_dummy_run=True, in_capturing=in_capturing)
            if sum(1 for n in self.seq_lens_this_time if n > 0) == 0:
                break

    def capture_model(self):
        if not self.use_cudagraph:
            return
        for capture_size in sorted(self.graph_opt_config.cudagraph_capture_sizes, reverse=True):
            self._dummy_run(num_tokens=MAX_CHUNK_TOKENS,
                            batch_size=int(capture_size / (NUM_SPECULATIVE_TOKENS + 1)),
                            expected_decode_len=(NUM_SPECULATIVE_TOKENS + 1) * 2, in_capturing=True,
                            accept_all_drafts=True)

    def execute_model(self):
        self._run_step()


PROMPTS = [[1, 7, 3], [4, 9, 12], [11, 6, 8], [13, 0, 10]]
MAX_DEC_LENS = [14, 14, 14, 7]
DECODE_STEPS = 8


def run(variant: str, device: str = "cpu"):
    def serve(use_cudagraph):
        runner = GPUModelRunner(variant, device, use_cudagraph)
        runner.capture_model()
        for idx, (prompt, max_dec_len) in enumerate(zip(PROMPTS, MAX_DEC_LENS)):
            runner.insert_request(idx, prompt, max_dec_len, temperature=0.0)
        runner.execute_model()                                # prefill (eager)
        outs = []
        for _ in range(DECODE_STEPS):
            runner.execute_model()
            outs.append(torch.tensor(runner.draft_tokens, dtype=torch.float32))
            outs.append(torch.tensor(runner.accept_num, dtype=torch.float32))
        width = max(MAX_DEC_LENS) + len(PROMPTS[0]) + 2
        outs.append(torch.tensor([s + [-1] * (width - len(s)) for s in runner.token_ids_all], dtype=torch.float32))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
