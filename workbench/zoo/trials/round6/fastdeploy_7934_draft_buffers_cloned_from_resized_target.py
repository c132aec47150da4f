"""An RL reset rebuilds the draft model's token buffers as clones of target tensors shrunk to the last step.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/7934 ("[Bugfix] Fix clear bug in RL causing CUDA
error 700 during CUDAGraph recapture"; cherry-picked to the release branch as #7933).
Symptom: RL training with MTP speculative decoding and ``draft_model_use_cudagraph=true``: after a rollout
round, the draft model's CUDA-graph recapture fails with CUDA error 700 (illegal memory access) when the
batch is large (FastDeploy, May 2026).
Mechanism: the MTP proposer's token-layout buffers (``ids_remove_padding``, ``batch_id_per_token``,
``cu_seqlens_q``, ...) are used by the draft graphs at the padded token count of each capture size. Between
RL rounds ``ProposerInputBatch.reset_model_inputs`` rebuilt them with ``paddle.clone`` of the target
model's tensors of the same name, but the target's tensors are reshaped at run time (``copy_(x, False)``
gives the destination the step's token count), so the clones are only as large as the last step's tokens.
The recapture then runs the largest capture size over buffers smaller than its token count: the graph's
kernels index past their end (error 700).
Doctor: undersized-buffer, at ``forward`` (of the MTP model: the captured read of ``capture size`` token
rows from the rebuilt ``ids_remove_padding``).
Fix (upstream): recreate those tensors at their full initial size (``max_num_seqs * max_chunk_tokens``
tokens, ``max_num_seqs + 1`` offsets) instead of cloning the possibly-resized target tensors, and reset
the stale ``seq_lens_this_time_buffer``.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/7934"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "forward"
SYMPTOM = "draft-model recapture after an RL round indexes past token buffers cloned at the last step's size"
NAME = "fastdeploy_7934_draft_buffers_cloned_from_resized_target"

VOCAB, HIDDEN, MAX_POS = 16, 4, 32
MAX_NUM_SEQS = 4
MAX_CHUNK_TOKENS = 2                           # accepted token + 1 speculative token per request
MAX_TOKENS = MAX_NUM_SEQS * MAX_CHUNK_TOKENS
CUDAGRAPH_CAPTURE_SIZES = [2, 4, 8]            # keyed by token count (ids_remove_padding.shape[0])
ROUNDS = [[3, 2], [3, 1]]                      # running requests per step, per RL rollout round


def paddle_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Paddle's ``Tensor.copy_(src, False)``: the destination takes the source's shape (its allocation
    stays), so after a step it is only as large as that step's token count."""
    dst.resize_(src.shape)
    dst.copy_(src)


def paddle_full(shape, fill_value, dtype, device):
    return torch.full(shape, fill_value, dtype=dtype, device=device)


class ForwardMeta:
    def __init__(self, token_num, batch_id_per_token, cu_seqlens_q, seq_lens_decoder):
        self.token_num = token_num
        self.batch_id_per_token = batch_id_per_token
        self.cu_seqlens_q = cu_seqlens_q
        self.seq_lens_decoder = seq_lens_decoder


class InputBatch:
    """The target model's share inputs (only the tensors the proposer inherits)."""

    def __init__(self, device):
        self.device = device

    def init_share_inputs(self):
        d = self.device
        self.ids_remove_padding = paddle_full([MAX_NUM_SEQS * MAX_CHUNK_TOKENS], 0, torch.int64, d)
        self.batch_id_per_token = paddle_full([MAX_NUM_SEQS * MAX_CHUNK_TOKENS], 0, torch.int64, d)
        self.cu_seqlens_q = paddle_full([MAX_NUM_SEQS + 1], 0, torch.int64, d)
        self.seq_lens_this_time = paddle_full([MAX_NUM_SEQS], 0, torch.int32, d)
        self.seq_lens_decoder = paddle_full([MAX_NUM_SEQS], 0, torch.int64, d)

    def __getitem__(self, key):
        return getattr(self, key)


class ProposerInputBatch(InputBatch):
    def __init__(self, device, target_model_input_batch: InputBatch):
        super().__init__(device)
        self.target_model_input_batch = target_model_input_batch

    def init_share_inputs(self):
        t = self.target_model_input_batch
        self.seq_lens_this_time_buffer = t["seq_lens_this_time"].clone()
        self.seq_lens_decoder = t["seq_lens_decoder"].clone()
        self.ids_remove_padding = t["ids_remove_padding"].clone()
        self.batch_id_per_token = t["batch_id_per_token"].clone()
        self.cu_seqlens_q = t["cu_seqlens_q"].clone()
        self.target_hidden_states = paddle_full([MAX_TOKENS, HIDDEN], 0.0, torch.float32, self.device)

    def reset_model_inputs(self, variant: str) -> None:
        """Between RL rounds: restore the proposer's buffers to their initial state."""
        t = self.target_model_input_batch
        self.seq_lens_decoder = t["seq_lens_decoder"].clone()
        if variant == "bug":
            # acceptance rate decline when reset seq_lens_this_time
            self.ids_remove_padding = t["ids_remove_padding"].clone()
            self.batch_id_per_token = t["batch_id_per_token"].clone()
            self.cu_seqlens_q = t["cu_seqlens_q"].clone()
        else:
            # These tensors get reshaped during runtime inference: recreate them at full initial size
            # instead of cloning the (possibly resized) target_model_input_batch tensors.
            self.seq_lens_this_time_buffer.zero_()
            self.ids_remove_padding = paddle_full([MAX_NUM_SEQS * MAX_CHUNK_TOKENS], 0, torch.int64, self.device)
            self.batch_id_per_token = paddle_full([MAX_NUM_SEQS * MAX_CHUNK_TOKENS], 0, torch.int64, self.device)
            self.cu_seqlens_q = paddle_full([MAX_NUM_SEQS + 1], 0, torch.int64, self.device)
        self.target_hidden_states.zero_()                       # fill_paddle_tensor(self, "target_hidden_states", 0)


def pre_process(input_ids, seq_lens_this_time, device):
    """Remove padding: the batch's token ids in one row, each token's request, cumulative offsets."""
    ids, batch_ids, cu = [], [], [0]
    for b, n in enumerate(seq_lens_this_time):
        ids += input_ids[b][:n]
        batch_ids += [b] * n
        cu.append(cu[-1] + n)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_t(ids), as_t(batch_ids), as_t(cu)


class Ernie4_5_MTPModel:
    """The draft head: token embedding + projected target hidden state + position, then the LM head."""

    def __init__(self, device, seed):
        gen = generator(seed)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.eh_proj = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
        self.pos_emb = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)

    def parameters(self):
        return [self.embed_tokens, self.eh_proj, self.pos_emb, self.lm_head]

    def forward(self, ids_remove_padding, previous_hidden_states, forward_meta: ForwardMeta):
        tok = torch.arange(forward_meta.token_num, device=ids_remove_padding.device)
        ids = ids_remove_padding.index_select(0, tok)                  # the kernels read token_num rows
        batch_id = forward_meta.batch_id_per_token.index_select(0, tok)
        positions = (forward_meta.seq_lens_decoder.index_select(0, batch_id)
                     + tok - forward_meta.cu_seqlens_q.index_select(0, batch_id))
        h = (self.embed_tokens[ids] + previous_hidden_states.index_select(0, tok) @ self.eh_proj
             + self.pos_emb[positions])
        return torch.tanh(h) @ self.lm_head


def target_forward(target_weights, ids):
    """The target model (run eagerly here): the hidden states the draft model consumes."""
    emb, w = target_weights
    return torch.tanh(emb[ids] @ w)


class MTPProposer:
    def __init__(self, device, target_inputs: InputBatch, model: Ernie4_5_MTPModel):
        self.device = device
        self.model = model
        self.model_inputs = ProposerInputBatch(device, target_inputs)
        self.model_inputs.init_share_inputs()
        self.graphs = GraphManager(self.run_static_model, CUDAGRAPH_CAPTURE_SIZES, device=device,
                                   mode=CUDAGraphMode.FULL, num_warmups=1, static_buffers=self._graph_buffers,
                                   name="MTP CudaGraphPiecewiseBackend")

    def _graph_buffers(self, size):
        mi = self.model_inputs
        return {"ids_remove_padding": mi.ids_remove_padding, "batch_id_per_token": mi.batch_id_per_token,
                "cu_seqlens_q": mi.cu_seqlens_q, "seq_lens_decoder": mi.seq_lens_decoder,
                "target_hidden_states": mi.target_hidden_states}

    def run_static_model(self, size):
        mi = self.model_inputs
        meta = ForwardMeta(size, mi.batch_id_per_token, mi.cu_seqlens_q, mi.seq_lens_decoder)
        return self.model.forward(mi.ids_remove_padding, mi.target_hidden_states, meta)

    def capture_model(self):
        if self.graphs.graphs:
            self.graphs.recapture()
        else:
            self.graphs.capture()

    def _prepare_inputs(self, ids, batch_ids, cu, seq_lens_decoder, hidden):
        """Write this step's draft inputs into the buffers; padded token rows are kept clean (zero)."""
        mi, n = self.model_inputs, ids.shape[0]
        mi.ids_remove_padding.zero_()
        mi.ids_remove_padding[:n] = ids
        mi.batch_id_per_token.zero_()
        mi.batch_id_per_token[:n] = batch_ids
        mi.cu_seqlens_q.fill_(cu[-1].item())
        mi.cu_seqlens_q[:cu.shape[0]] = cu
        mi.seq_lens_decoder.zero_()
        mi.seq_lens_decoder[:seq_lens_decoder.shape[0]] = seq_lens_decoder
        mi.target_hidden_states.zero_()
        mi.target_hidden_states[:n] = hidden

    def _propose(self, n_tokens):
        size = self.graphs.dispatch(n_tokens)
        return self.graphs.replay(size, real=n_tokens)


def schedule():
    """Per RL round, per step: each running request's two verify tokens and its decoded length."""
    gen = torch.Generator().manual_seed(7934)
    rounds = []
    for r, steps in enumerate(ROUNDS):
        out = []
        for s, n_seqs in enumerate(steps):
            input_ids = torch.randint(0, VOCAB, (n_seqs, MAX_CHUNK_TOKENS), generator=gen).tolist()
            seq_lens_decoder = [5 + 3 * b + 2 * s + 7 * r for b in range(n_seqs)]
            out.append((input_ids, [MAX_CHUNK_TOKENS] * n_seqs, seq_lens_decoder))
        rounds.append(out)
    return rounds


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    target_weights = (randn(VOCAB, HIDDEN, gen=gen, device=device), randn(HIDDEN, HIDDEN, gen=gen, device=device))
    round_weights = [Ernie4_5_MTPModel(device, seed).parameters() for seed in (10, 11)]
    rounds = schedule()

    def eager():
        model, outs = Ernie4_5_MTPModel(device, 10), []
        for weights, steps in zip(round_weights, rounds):
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
            for input_ids, seq_lens_this_time, seq_lens_decoder in steps:
                ids, batch_ids, cu = pre_process(input_ids, seq_lens_this_time, device)
                hidden = target_forward(target_weights, ids)
                meta = ForwardMeta(ids.shape[0], batch_ids, cu, torch.tensor(seq_lens_decoder, device=device))
                outs.append(model.forward(ids, hidden, meta))
        return outs

    def served():
        target_inputs = InputBatch(device)
        target_inputs.init_share_inputs()
        model = Ernie4_5_MTPModel(device, 10)
        proposer = MTPProposer(device, target_inputs, model)
        outs = []
        for r, (weights, steps) in enumerate(zip(round_weights, rounds)):
            if r > 0:                                   # RL: clear, update weights in place, recapture
                proposer.model_inputs.reset_model_inputs(variant)
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
            proposer.capture_model()
            for input_ids, seq_lens_this_time, seq_lens_decoder in steps:
                ids, batch_ids, cu = pre_process(input_ids, seq_lens_this_time, device)
                paddle_copy_(target_inputs.ids_remove_padding, ids)          # target _prepare_inputs
                paddle_copy_(target_inputs.batch_id_per_token, batch_ids)
                paddle_copy_(target_inputs.cu_seqlens_q, cu)
                hidden = target_forward(target_weights, target_inputs.ids_remove_padding)
                proposer._prepare_inputs(ids, batch_ids, cu, torch.tensor(seq_lens_decoder, device=device), hidden)
                outs.append(proposer._propose(ids.shape[0]).clone())
        return outs

    return compare(NAME, variant, device, served, eager)
