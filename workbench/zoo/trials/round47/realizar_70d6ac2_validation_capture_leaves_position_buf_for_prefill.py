"""A validation capture leaves ``position_buf = [0]``; the next eager prefill scatters all prompt K/V to slot 0.

Upstream: https://github.com/paiml/realizar/commit/70d6ac2b140f9da78726ba3ddc2dc1757c420c97 ("fix: Clear stale CUDA
graph state before generation to fix batched prefill KV scatter (Refs #219)"), a direct commit on main (no PR).
Symptom: after ``validate_gpu_first_token()`` (a one-token BOS probe through ``generate_gpu_resident``), the real
generation produced garbage output on the GPU-resident path (1.5B and 7B Qwen models); correct after the fix.
Mechanism: the graphed decode path (PAR-054, ``forward_all_layers_gpu_to_logits_graphed``) lazily creates the
device buffers its graph reads, ``position_buf = Some(from_host([position]))`` and ``seq_len_buf``, and captures the
decode graph; the BOS probe leaves them at ``[0]`` / ``[1]``. The next ``generate_gpu_resident`` calls only
``reset_kv_cache_gpu()`` (host ``kv_cache_lengths`` to 0), not ``clear_decode_graph()``. Its batched prefill
(``prefill_all_layers_gpu`` -> ``transformer_layer_batched``, sequential attention path) calls
``incremental_attention_into_for_capture`` per prompt token, and ``incremental_attention_into_inner`` picks its KV
scatter with ``if let Some(ref pos_buf) = self.position_buf`` (PAR-069): the INDIRECT scatter reads the position
from the stale device buffer (0) for every token, instead of the direct scatter at ``cache_len``; the attention
kernel likewise reads ``seq_len_buf`` (1). All prompt K/V land in slot 0; the decode that follows (re-captured at
the right position after prefill's own ``clear_decode_graph``) attends over a cache whose slots ``1..n`` were never
written. Without graphs (``forward_all_layers_gpu_to_logits``) the buffers never exist and prefill scatters
directly. Modelled with one layer, one head and a 4-wide hidden state; the kernels are torch ops.
Doctor: stale-input, at incremental_attention_into_inner (the prefill's KV scatter reads the decode graph's static
``position_buf``, which the prefill step never wrote: it holds what the validation capture left).
Fix (upstream): both ``generate_gpu_resident*`` functions call ``self.executor.clear_decode_graph()`` right after
``reset_kv_cache_gpu()``, which sets ``decode_graph``, ``graph_input_buf``, ``position_buf`` and ``seq_len_buf`` to
``None``, so the prefill takes the direct scatter at the host ``kv_cache_lengths`` counter.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/paiml/realizar/commit/70d6ac2b140f9da78726ba3ddc2dc1757c420c97"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "incremental_attention_into_inner"
SYMPTOM = "garbage output: every prompt token's K/V scattered to position 0 through a stale position_buf"

VOCAB, HIDDEN, MAX_LEN, THETA = 16, 4, 8, 10.0
BOS = 1


class Weights:
    def __init__(self, device):
        gen = generator(219)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.8)
                                              for _ in range(4))
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        half = HIDDEN // 2
        self.inv_freq = (THETA ** -(torch.arange(half, dtype=torch.float32) / half)).to(device)


def rope_into(w, x, positions):
    """NORM-style RoPE (one rotation per pair of halves) of rows ``x`` [rows, HIDDEN] at ``positions`` [rows]."""
    half = HIDDEN // 2
    ang = positions.to(x.dtype)[:, None] * w.inv_freq[None, :]
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


class CudaExecutor:
    def __init__(self, w, device, graphed):
        self.w, self.device, self.graphed = w, device, graphed
        self.kv_cache_gpu = {"kv_0_k": torch.zeros(MAX_LEN, HIDDEN, device=device),
                             "kv_0_v": torch.zeros(MAX_LEN, HIDDEN, device=device)}
        self.kv_cache_lengths = {0: 0}
        self.ctx_pos = torch.arange(MAX_LEN, device=device)
        self.decode_graph = None
        self.decode_token_count = 0
        self.decode_logits = None
        self.graph_input_buf = None
        self.position_buf = None           # PAR-054: made by the graphed decode path only
        self.seq_len_buf = None

    def reset_kv_cache_gpu(self):
        """PAR-055: cache lengths back to 0 (the graph state is not touched)."""
        for layer in self.kv_cache_lengths:
            self.kv_cache_lengths[layer] = 0

    def clear_decode_graph(self):
        self.decode_graph = None
        self.decode_token_count = 0
        self.decode_logits = None
        self.graph_input_buf = None
        self.position_buf = None
        self.seq_len_buf = None

    def incremental_attention_into_inner(self, layer_idx, q, k, v, skip_debug):
        """Append one token's K/V to the layer's cache (scatter), then attend over the cache (rows: [1, HIDDEN])."""
        k_cache, v_cache = self.kv_cache_gpu[f"kv_{layer_idx}_k"], self.kv_cache_gpu[f"kv_{layer_idx}_v"]
        cache_len = self.kv_cache_lengths[layer_idx]
        new_len = cache_len + 1
        if self.position_buf is not None:
            # PAR-069: graph mode (indirect scatter): the position is read from device memory
            k_cache.index_copy_(0, self.position_buf, k)
            v_cache.index_copy_(0, self.position_buf, v)
        else:
            # Normal mode: direct scatter at the host cache length
            k_cache[cache_len:new_len].copy_(k)
            v_cache[cache_len:new_len].copy_(v)
        self.kv_cache_lengths[layer_idx] = new_len
        # use_graph_mode = seq_len_buf.is_some(): the indirect attention kernel reads seq_len from the device
        seq_len = self.seq_len_buf if self.seq_len_buf is not None else new_len
        scores = (q @ k_cache.T).masked_fill(~(self.ctx_pos < seq_len)[None, :], -1e9)
        return torch.softmax(scores, -1) @ v_cache

    def incremental_attention_into_for_capture(self, layer_idx, q, k, v):
        return self.incremental_attention_into_inner(layer_idx, q, k, v, True)

    def transformer_layer_indexed(self, x, position, skip_debug):
        """One decode token (x: [1, HIDDEN]); RoPE reads ``position_buf`` in graph mode (PAR-070)."""
        w = self.w
        if skip_debug and self.position_buf is not None:
            pos = self.position_buf
        else:
            pos = torch.full((1,), position, dtype=torch.long, device=self.device)
        q, k, v = rope_into(w, x @ w.wq, pos), rope_into(w, x @ w.wk, pos), x @ w.wv
        return x + self.incremental_attention_into_inner(0, q, k, v, skip_debug) @ w.wo

    def transformer_layer_batched(self, x, positions):
        """PMAT-PREFILL: batched projections and RoPE (positions from the host), sequential attention."""
        w = self.w
        q, k, v = rope_into(w, x @ w.wq, positions), rope_into(w, x @ w.wk, positions), x @ w.wv
        attn = torch.cat([self.incremental_attention_into_for_capture(0, q[i:i + 1], k[i:i + 1], v[i:i + 1])
                          for i in range(x.shape[0])])
        return x + attn @ w.wo

    def prefill_all_layers_gpu(self, embeddings, positions):
        return self.transformer_layer_batched(embeddings, positions)

    def forward_all_layers_gpu_to_logits(self, x, position):
        """The non-graphed decode path."""
        return self.transformer_layer_indexed(x, position, False) @ self.w.lm_head

    def forward_workspace_captured(self):
        """What the decode graph captures: everything reads ``graph_input_buf`` / ``position_buf`` / ``seq_len_buf``."""
        return self.transformer_layer_indexed(self.graph_input_buf, 0, True) @ self.w.lm_head

    def forward_all_layers_gpu_to_logits_graphed(self, x, position):
        if self.decode_graph is not None and self.decode_token_count > 0:
            return self.forward_graphed_replay(x, position)
        # PAR-054: initialize position buffer if needed (else update it); PAR-061: same for seq_len
        if self.position_buf is None:
            self.position_buf = torch.tensor([position], dtype=torch.long, device=self.device)
        else:
            self.position_buf.fill_(position)
        if self.seq_len_buf is None:
            self.seq_len_buf = torch.tensor([position + 1], dtype=torch.long, device=self.device)
        else:
            self.seq_len_buf.fill_(position + 1)
        if self.graph_input_buf is None:
            self.graph_input_buf = x.clone()
        else:
            self.graph_input_buf.copy_(x)
        self.decode_graph, self.decode_logits = capture(
            self.forward_workspace_captured, device=self.device, warmups=0,
            owner="CudaExecutor (decode graph)",
            static={"graph_input_buf": self.graph_input_buf, "position_buf": self.position_buf,
                    "seq_len_buf": self.seq_len_buf},
            state=self.kv_cache_gpu)
        self.decode_token_count = 1
        # CORRECTNESS-010: capture computes nothing; launch the graph once for the first token
        return replay(self.decode_graph, self.decode_logits)

    def forward_graphed_replay(self, x, position):
        self.position_buf.fill_(position)
        self.seq_len_buf.fill_(position + 1)
        self.graph_input_buf.copy_(x)
        self.decode_token_count += 1
        return replay(self.decode_graph, self.decode_logits)


class OwnedQuantizedModelCuda:
    def __init__(self, w, device, variant, graphed):
        self.w, self.device, self.variant = w, device, variant
        self.executor = CudaExecutor(w, device, graphed)

    def forward_gpu_resident(self, token, position):
        x = self.w.emb[token][None, :]
        if self.executor.graphed:
            return self.executor.forward_all_layers_gpu_to_logits_graphed(x, position)
        return self.executor.forward_all_layers_gpu_to_logits(x, position)

    def generate_gpu_resident(self, prompt, max_tokens):
        self.executor.reset_kv_cache_gpu()
        if self.variant == "fix":
            # PMAT-PREFILL-FIX: clear stale graph state (position_buf, seq_len_buf) from a previous generation
            self.executor.clear_decode_graph()
        prefill_count = len(prompt) - 1          # all except the last (which feeds the decode)
        if prefill_count > 0:
            tokens = torch.tensor(prompt[:prefill_count], dtype=torch.long, device=self.device)
            positions = torch.arange(prefill_count, device=self.device)
            self.executor.prefill_all_layers_gpu(self.w.emb[tokens], positions)
            # the decode graph was captured for an old position: re-capture at position=prefill_count
            self.executor.clear_decode_graph()
        position, last_token, logits_out = len(prompt) - 1, prompt[-1], []
        for _ in range(max_tokens):
            logits = self.forward_gpu_resident(last_token, position).clone()
            logits_out.append(logits)
            last_token, position = int(logits.argmax()), position + 1
        return logits_out


def validate_gpu_first_token(model):
    """F2-VALIDATION: one token from a single BOS probe (its CPU comparison is left out)."""
    return model.generate_gpu_resident([BOS], max_tokens=1)


def run(variant: str, device: str = "cpu"):
    w = Weights(device)

    def serve(graphed: bool):
        model = OwnedQuantizedModelCuda(w, device, variant, graphed)
        outs = validate_gpu_first_token(model)
        outs += model.generate_gpu_resident([3, 7, 2, 9, 5], max_tokens=3)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
