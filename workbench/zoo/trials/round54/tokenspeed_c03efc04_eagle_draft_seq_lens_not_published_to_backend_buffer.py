"""EAGLE draft under CUDA graphs attends over a stale length: its seq_lens edits never reach the backend's buffer.

Upstream: https://github.com/lightseekorg/tokenspeed/commit/c03efc04c504f9ac2cb708dcfed3879247666f59
("fix(spec-decode): keep draft seq_lens visible now that backends own the buffer").
Symptom: "all fail silently -- attention runs over a wrong history length with no error" (commit message): graphed
draft steps attend over the wrong number of KV slots, giving wrong draft tokens and a lower acceptance.
Mechanism: a refactor made each attention backend own its cache-seqlens buffer (``MHAAttnBackend.cuda_graph_seq_lens``,
zero-initialised by ``init_cuda_graph_state``): graph metadata views it, ``init_forward_metadata_replay_cuda_graph``
copies the live lengths in before each replay, while eager metadata (``init_forward_metadata``) still aliases the
drafter's ``draft_seq_lens_buf``. Inside the captured forward the drafter edits that tensor: ``LlamaAttention.
_apply_correction`` trims the rejected tail before draft step 0 (``seq_lens_buf[num_extends:bs].sub_(spec_num_tokens
- accept_lengths).clamp_(min=1)``), and ``EagleDrafter._run_multi_step_decode`` sets ``cache_start + 1`` then
``draft_seq_lens.add_(1)`` per step, relying on ``_advance_draft_forward_metadata_if_supported`` to publish each value;
only deepseek_v4/dsa/inkling defined ``advance_draft_forward_metadata``, so for MHA the helper skipped silently. Eager
sees every edit through the alias; each replay reads the owned buffer, still holding the untrimmed verify length
``vc + N`` copied in by the replay prep, at step 0 and every later step: the draft attends over rejected-tail KV and
never over its own new slots. (The capture run itself read the zero-initialised buffer: seq_len 0.)
Doctor: stale-input, at _advance_draft_forward_metadata_if_supported (the per-draft-step refresh of
``cuda_graph_seq_lens`` is skipped: the graph reads lengths the replay prep left there, not this draft step's).
Fix (upstream): ``AttentionBackend`` gets a default ``advance_draft_forward_metadata`` copying into
``getattr(self, self.draft_seq_lens_attr)`` (a no-op before ``init_cuda_graph_state``); ``_apply_correction``
publishes the trimmed lengths; the decode capture seeds the owned buffer from the capture seq_lens.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/lightseekorg/tokenspeed/commit/c03efc04c504f9ac2cb708dcfed3879247666f59"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "_advance_draft_forward_metadata_if_supported"
SYMPTOM = "graphed EAGLE draft steps attend over the untrimmed verify length, not the draft's seq_lens: wrong drafts"

HIDDEN, VOCAB, MAX_LEN, MAX_REQS, MAX_BS = 8, 16, 24, 3, 2
SPEC_NUM_STEPS, SPEC_NUM_TOKENS = 3, 4        # draft steps; N candidates verified per request


class DecodeMetadata:
    def __init__(self, seq_lens, req_pool_indices):
        self.seq_lens, self.req_pool_indices = seq_lens, req_pool_indices


class AttentionBackend:
    spec_num_tokens = SPEC_NUM_TOKENS
    # Backend-owned cuda-graph cache-seqlens buffer the decode metadata views.
    draft_seq_lens_attr: str = "cuda_graph_seq_lens"

    def advance_draft_forward_metadata(self, seq_lens: torch.Tensor) -> None:
        """Publish the drafter's in-graph seq_lens edits into our own buffer (added by the fix)."""
        buf = getattr(self, self.draft_seq_lens_attr, None)
        if buf is None:
            return
        bs = seq_lens.shape[0]
        buf[:bs].copy_(seq_lens[:bs])


class MHAAttnBackend(AttentionBackend):
    def __init__(self, device, variant, k_buffer, v_buffer):
        self.device, self.variant, self.k_buffer, self.v_buffer = device, variant, k_buffer, v_buffer
        self.forward_decode_metadata, self.cuda_graph_decode_metadata = None, {}
        if variant == "bug":
            # Before the fix only deepseek_v4 / dsa / inkling defined the hook; MHA had none.
            self.advance_draft_forward_metadata = None

    def init_cuda_graph_state(self, max_bs):
        self.cuda_graph_seq_lens = torch.zeros(max_bs, dtype=torch.int64, device=self.device)

    def init_forward_metadata(self, bs, req_pool_indices, seq_lens):
        # Eager: the metadata aliases the caller's (the drafter's) tensor.
        self.forward_decode_metadata = DecodeMetadata(seq_lens[:bs], req_pool_indices[:bs])

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens):
        metadata = DecodeMetadata(self.cuda_graph_seq_lens[:bs], req_pool_indices[:bs])
        if self.variant == "fix":
            # Seed the owned buffer: the capture run reads it before replay.
            metadata.seq_lens.copy_(seq_lens[:bs])
        self.cuda_graph_decode_metadata[bs] = metadata
        self.forward_decode_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens):
        # Backend owns its cache-seqlens buffer (previously aliased the controller's seq_lens_buf).
        self.cuda_graph_seq_lens[:bs].copy_(seq_lens[:bs])
        self.forward_decode_metadata = self.cuda_graph_decode_metadata[bs]

    def forward_decode(self, q, k, v, out_cache_loc):
        md = self.forward_decode_metadata
        self.k_buffer[md.req_pool_indices, out_cache_loc], self.v_buffer[md.req_pool_indices, out_cache_loc] = k, v
        keys, values = self.k_buffer[md.req_pool_indices], self.v_buffer[md.req_pool_indices]
        scores = (keys @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(HIDDEN)
        valid = torch.arange(MAX_LEN, device=q.device).unsqueeze(0) < md.seq_lens.unsqueeze(1)
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
        return (probs.unsqueeze(1) @ values).squeeze(1)


class ForwardContext:
    def __init__(self, attn_backend, bs, num_extends=0, draft_seq_lens_buf=None, accept_lengths=None):
        self.attn_backend, self.bs, self.num_extends = attn_backend, bs, num_extends
        self.draft_seq_lens_buf, self.accept_lengths = draft_seq_lens_buf, accept_lengths


class LlamaForCausalLMEagle3:
    def __init__(self, device, variant):
        gen, self.variant = generator(5403), variant
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.fc = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.pos = randn(MAX_LEN, HIDDEN, gen=gen, device=device, scale=0.3)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)

    def _apply_correction(self, ctx):
        """Trim decode rows' cache_seqlens by ``spec_num_tokens - accept_lengths`` (LlamaAttention)."""
        seq_lens_buf = ctx.draft_seq_lens_buf
        if seq_lens_buf is None or ctx.accept_lengths is None:
            return
        num_extends = ctx.num_extends           # 0 here: an all-decode batch
        correction = (ctx.attn_backend.spec_num_tokens - ctx.accept_lengths[num_extends:]).to(seq_lens_buf.dtype)
        seq_lens_buf[num_extends:ctx.bs].sub_(correction).clamp_(min=1)
        if self.variant == "fix":
            # Publish: the backend owns its buffer, so in-graph edits need a copy.
            ctx.attn_backend.advance_draft_forward_metadata(seq_lens_buf[:ctx.bs])

    def forward(self, ctx, input_ids, positions, out_cache_loc, captured_hidden_states, spec_step_idx):
        h = torch.tanh(self.embed_tokens[input_ids] + captured_hidden_states @ self.fc + self.pos[positions])
        if spec_step_idx == 0:
            self._apply_correction(ctx)
        attn = ctx.attn_backend.forward_decode(h @ self.wq, h @ self.wk, h @ self.wv, out_cache_loc)
        hidden = h + torch.tanh(attn @ self.wo)
        return hidden @ self.lm_head, hidden


def _advance_draft_forward_metadata_if_supported(attn_backend, seq_lens) -> None:
    advance = getattr(attn_backend, "advance_draft_forward_metadata", None)
    if advance is not None:
        advance(seq_lens)


class InputBuffers:
    def __init__(self, device):
        z = lambda *s: torch.zeros(*s, dtype=torch.int64, device=device)  # noqa: E731
        self.seq_lens_buf, self.req_pool_indices_buf, self.accept_lengths_buf = z(MAX_BS), z(MAX_BS), z(MAX_BS)
        self.input_ids_buf, self.positions_buf, self.valid_cache_lengths = z(MAX_BS), z(MAX_BS), z(MAX_REQS)
        self.hidden_states_buf = torch.zeros(MAX_BS, HIDDEN, device=device)


class EagleDrafter:
    def __init__(self, device, variant, attn_backend, input_buffers):
        self.attn_backend, self.input_buffers = attn_backend, input_buffers
        self.model = LlamaForCausalLMEagle3(device, variant)
        # Drafter-owned alias source for the draft attn backend; advanced in place during multi-step decode.
        self.draft_seq_lens_buf = torch.zeros_like(input_buffers.seq_lens_buf)
        self.next_tokens = torch.zeros(MAX_BS, SPEC_NUM_STEPS + 1, dtype=torch.int64, device=device)

    def _run_multi_step_decode(self, bs, draft_ids, hidden):
        buffers = self.input_buffers
        req_pool_indices = buffers.req_pool_indices_buf[:bs]
        cache_start = buffers.valid_cache_lengths.index_select(0, req_pool_indices) + buffers.accept_lengths_buf[:bs]
        # +1 is the kernel's read-inclusive convention; advanced per iter.
        draft_seq_lens = self.draft_seq_lens_buf[:bs]
        torch.add(cache_start, 1, out=draft_seq_lens)
        positions = cache_start.clone()
        for i in range(1, SPEC_NUM_STEPS):
            ctx = ForwardContext(self.attn_backend, bs)
            _advance_draft_forward_metadata_if_supported(ctx.attn_backend, draft_seq_lens)
            logits, hidden = self.model.forward(ctx, draft_ids, positions, positions.clone(), hidden, i)
            self.next_tokens[:bs, i + 1] = draft_ids = logits.argmax(dim=-1)
            if i + 1 < SPEC_NUM_STEPS:
                positions.add_(1)
                draft_seq_lens.add_(1)
        return hidden

    def draft(self, bs):
        buffers = self.input_buffers
        self.next_tokens[:bs, 0] = buffers.input_ids_buf[:bs]
        # Seed the draft attn backend's aliased seq_lens for the first step.
        self.draft_seq_lens_buf[:bs].copy_(buffers.seq_lens_buf[:bs])
        ctx = ForwardContext(self.attn_backend, bs, 0, self.draft_seq_lens_buf, buffers.accept_lengths_buf[:bs])
        logits, hidden = self.model.forward(ctx, buffers.input_ids_buf[:bs], buffers.positions_buf[:bs],
                                            buffers.positions_buf[:bs], buffers.hidden_states_buf[:bs], 0)
        self.next_tokens[:bs, 1] = logits.argmax(dim=-1)
        return self.next_tokens[:bs], self._run_multi_step_decode(bs, self.next_tokens[:bs, 1].clone(), hidden)


class CudaGraphWrapper:
    def __init__(self, device, variant, use_cuda_graph):
        gen = generator(54)
        # KV pool rows per request: target KV (and stale rejected-tail draft KV) everywhere; row 0 is the dummy.
        self.k_buffer = randn(MAX_REQS, MAX_LEN, HIDDEN, gen=gen, device=device)
        self.v_buffer = randn(MAX_REQS, MAX_LEN, HIDDEN, gen=gen, device=device)
        self.device, self.use_cuda_graph, self.input_buffers = device, use_cuda_graph, InputBuffers(device)
        self.draft_attn_backend = MHAAttnBackend(device, variant, self.k_buffer, self.v_buffer)
        self.drafter, self.graphs = EagleDrafter(device, variant, self.draft_attn_backend, self.input_buffers), {}
        if use_cuda_graph:                # eager runs never call it: the advance hook no-ops there
            self.draft_attn_backend.init_cuda_graph_state(MAX_BS)

    def _capture_one(self, bs):
        ib = self.input_buffers
        # Keep warmup seq_lens >= q_len_per_req so no query row gets an empty causal span.
        ib.seq_lens_buf[:bs].fill_(SPEC_NUM_TOKENS)
        self.draft_attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, ib.req_pool_indices_buf[:bs], ib.seq_lens_buf[:bs])
        static = dict(vars(ib), cuda_graph_seq_lens=self.draft_attn_backend.cuda_graph_seq_lens)
        state = {"k_buffer": self.k_buffer, "v_buffer": self.v_buffer,
                 "draft_seq_lens_buf": self.drafter.draft_seq_lens_buf}
        self.graphs[bs] = capture(lambda: self.drafter.draft(bs), device=self.device, static=static, state=state,
                                  owner="CudaGraphWrapper", name=f"decode+draft bs={bs}")

    def forward(self, req_pool_indices, valid_cache_lengths, accept_lengths, verified_ids, hidden_states):
        bs, ib = req_pool_indices.shape[0], self.input_buffers
        ib.valid_cache_lengths.index_copy_(0, req_pool_indices, valid_cache_lengths)
        # seq_lens after target verify count all N candidates; position = last accepted token.
        for buf, value in ((ib.req_pool_indices_buf, req_pool_indices), (ib.accept_lengths_buf, accept_lengths),
                           (ib.seq_lens_buf, valid_cache_lengths + SPEC_NUM_TOKENS), (ib.input_ids_buf, verified_ids),
                           (ib.positions_buf, valid_cache_lengths + accept_lengths - 1),
                           (ib.hidden_states_buf, hidden_states)):
            buf[:bs].copy_(value)
        draft_seq_lens = self.drafter.draft_seq_lens_buf[:bs].copy_(ib.seq_lens_buf[:bs])
        if self.use_cuda_graph:          # _init_replay_metadata
            self.draft_attn_backend.init_forward_metadata_replay_cuda_graph(
                bs, ib.req_pool_indices_buf[:bs], draft_seq_lens)
            g, out = self.graphs[bs]
            tokens, hidden = replay(g, out)
        else:                            # _init_forward_metadata: seq_lens aliased to the drafter-owned buffer
            self.draft_attn_backend.init_forward_metadata(bs, ib.req_pool_indices_buf[:bs], draft_seq_lens)
            tokens, hidden = self.drafter.draft(bs)
        return [tokens.clone().to(torch.float64), hidden.clone()]


def run(variant: str, device: str = "cpu"):
    gen, req_pool_indices = generator(3), torch.tensor([1, 2])
    rounds = [torch.tensor(a) for a in ([2, 4], [1, 3], [3, 1])]
    hiddens = [torch.randn(MAX_BS, HIDDEN, generator=gen) for _ in rounds]
    verified = [torch.randint(0, VOCAB, (MAX_BS,), generator=gen) for _ in rounds]

    def serve(graphed):
        wrapper = CudaGraphWrapper(device, variant, graphed)
        if graphed:
            wrapper._capture_one(MAX_BS)          # captured once, for the served batch size
        vc, outs = torch.tensor([5, 7]), []
        for accept, hidden, ids in zip(rounds, hiddens, verified):
            outs += wrapper.forward(req_pool_indices.to(device), vc.to(device), accept.to(device), ids.to(device),
                                    hidden.to(device))
            vc = vc + accept
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
