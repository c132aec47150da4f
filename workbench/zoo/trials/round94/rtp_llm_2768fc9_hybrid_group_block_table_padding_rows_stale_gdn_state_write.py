"""rtp-llm decode CUDA graph for Qwen3-Next: the per-group (hybrid cache) block tables are copied into the graph's buffers without clearing them, so a padding row keeps an earlier request's block ids and the Gated-DeltaNet kernel writes its state into a block that now belongs to a live request.

Upstream: https://github.com/alibaba/rtp-llm/commit/2768fc9223e9564f182a984a83b3301b5d33e410 ("fix: fix qwen3 next decode
padding", alibaba/rtp-llm, on main, 2026-04-08; a direct commit, no PR text). Read: the commit's diff of
``rtp_llm/cpp/cuda/CudaGraph/CudaGraphRunner.cc`` (``CudaGraphRunner::prepareInputs``: before copying each group's
``kv_cache_kernel_block_id_{device,host}_by_group[g]`` with ``copySmallerIntoLarger``, the fix adds ``fill_(0)`` with the
comment "Without this, padding entries retain stale block IDs from previous calls, causing linear attention
(GatedDeltaNet) to corrupt SSM/conv states of stale blocks"), and at the parent commit the whole ``prepareInputs`` (the
non-grouped ``kv_cache_kernel_block_id_device`` was already cleared "otherwise it will cause the cache block pollution";
``sequence_lengths_plus_1_d`` and ``input_ids`` are copied for the real rows only), ``models_py/model_desc/qwen3_next.py``
(``Qwen3NextGatedDeltaNetDecode._fla`` calling ``fused_recurrent_gated_delta_rule(..., inplace_final_state=True,
block_map=attn_inputs.kv_cache_kernel_block_id_device, sequence_lengths=attn_inputs.sequence_lengths_plus_1_d)``; the
model's ``forward`` calling ``select_block_map_for_layer`` per layer), ``models_py/model_desc/block_map.py``
(``select_block_map_for_layer`` swapping in ``..._by_group[gid]``) and ``models_py/triton_kernels/fla/fused_recurrent.py``
(the kernel: ``cal_block_idx(x, bs) = (x - 1) // bs``; read block ``block_map[n, cal_block_idx(seq - 1)]``, ``if
read_block_id <= 0: return``; write block ``block_map[n, cal_block_idx(seq) + t]``). Reconstructed: the serving
scenario (which request's block a padding row hits) is mine; the conv1d state update is left out.
Symptom: Qwen3-Next served with decode CUDA graphs: after a request finishes and the decode batch shrinks to a padded
size, a request admitted into the freed cache blocks decodes from a corrupted linear-attention (SSM) state and produces
wrong tokens; eager decode (and unpadded batches) are correct.
Mechanism: every graph instance reads slices of one set of max-sized input buffers. ``prepareInputs`` copies the real
rows' per-group block tables into the top-left corner (``copySmallerIntoLarger``) and the real rows' sequence lengths,
leaving the padding rows as the previous call left them. The captured GDN kernel runs all ``padded_bs`` rows; a padding
row whose table row still holds a finished request's block ids passes the ``read_block_id <= 0`` guard, reads the state
in that stale block and writes its updated state back in place into the stale write block. Once the finished request's
blocks are handed to a new request, that write overwrites the new request's freshly prefilled state. Eager decode runs
the real rows only.
Doctor: stale-padding, at prepareInputs. The new request's real rows depend on what the padding rows hold: block ids (and
lengths) left from an earlier step, which the captured kernel follows to write into a block it no longer owns.
Fix (upstream): ``fill_(0)`` each group's device and host block table before copying the real rows in, so padding rows
carry block id 0 and the kernel skips them (``read_block_id <= 0``).
Modelled: ``CudaGraphRunner`` (capture range [1, 2, 4] largest first, graph instances sharing slices of the max-sized
``capture_mem_hold_`` buffers, ``prepareInputs``, ``copySmallerIntoLarger``, ``forward`` padding to the captured size),
``PyAttentionInputs`` fields (``sequence_lengths_plus_1_d``, ``kv_cache_kernel_block_id_device``,
``kv_cache_kernel_block_id_device_by_group``, ``kv_cache_layer_to_group``), ``select_block_map_for_layer``,
``Qwen3NextGatedDeltaNetDecode._fla`` and ``fused_recurrent_gated_delta_rule`` (one head, K = V = 4, l2-normalised q/k,
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, states kept per cache block, read/write offsets and
the ``read_block_id <= 0`` skip as in the kernel), ``store_ssm_state_to_block_map`` at prefill. Stand-ins: the model is
embedding + one GDN layer (linear cache group 0) + lm head; prefill is an eager recurrence that stores the final state;
the block allocator is a LIFO free list (block 0 reserved); tokens are fed back greedily; ``PyModelInputs.by_value``
stands for pybind handing the Python forward a copy of the C++ struct (so ``select_block_map_for_layer`` rebinds the
copy's ``kv_cache_kernel_block_id_device``, not the runner's). Hidden 8, vocab 16, block size 4 tokens, float64.
Workload: requests A, B, C, D are prefilled (prompts 3, 5, 2, 6 tokens) and decode as one 4-row batch; D stops after
2 tokens and its blocks (15, 14) are freed. Step 2: E (prompt 4) is prefilled into D's freed blocks (its state lands in
block 14, D's last state block) while [A, B, C] decode in the 4-row graph, whose padding row still holds D's block
table and length: in the bug it reads E's state from block 14 and writes it back advanced by D's stale last token.
Steps 3-5: [A, B, C, E] decode unpadded; E's logits differ from eager at each of its decode steps (by 0.19, 0.41, 0.37;
its third token changes), A-D match. The fix equals eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/2768fc9223e9564f182a984a83b3301b5d33e410"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "prepareInputs"
SYMPTOM = ("Qwen3-Next decode CUDA graphs: the hybrid-cache per-group block tables are not cleared before the real rows "
           "are copied in, so a padding row keeps a finished request's block ids and the Gated-DeltaNet kernel writes its "
           "state into a block now owned by a newly admitted request, whose output then goes wrong")

HIDDEN, VOCAB, K = 8, 16, 4
SEQ_SIZE_PER_BLOCK = 4
MAX_BLOCKS = 4                      # max blocks per sequence in the kernel block table
NUM_BLOCKS = 24                     # linear-cache blocks; block 0 is reserved (never handed out)
CAPTURE_RANGE = [1, 2, 4]
MAX_BS = max(CAPTURE_RANGE)

_variant = "bug"


# --- models_py/triton_kernels/fla/fused_recurrent.py ------------------------------------------------------------------

def cal_block_idx(x, seq_size_per_block):
    return (x - 1) // seq_size_per_block


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, inplace_final_state, block_map,
                                     seq_size_per_block, sequence_lengths, eps=1e-6):
    """One decode token per row, states kept per cache block (continuous batching, in-place final state)."""
    assert inplace_final_state
    seq = sequence_lengths.to(torch.int64)
    load_off = cal_block_idx(seq - 1, seq_size_per_block).clamp(min=0).unsqueeze(1)
    write_off = cal_block_idx(seq, seq_size_per_block).clamp(min=0).unsqueeze(1)
    read_block_id = block_map.gather(1, load_off).squeeze(1).to(torch.int64)
    write_block_id = block_map.gather(1, write_off).squeeze(1).to(torch.int64)
    live = read_block_id > 0                                   # `if read_block_id <= 0: return`
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
    h = initial_state[read_block_id] * torch.exp(g)[:, None, None]
    v = (v - (h * k[:, :, None]).sum(1)) * beta[:, None]
    h = h + k[:, :, None] * v[:, None, :]
    o = (h * q[:, :, None]).sum(1)
    keep = initial_state[write_block_id]
    initial_state[write_block_id] = torch.where(live[:, None, None], h, keep)
    return torch.where(live[:, None], o, torch.zeros_like(o))


def store_ssm_state_to_block_map(ssm_states, state, block_ids, seq_len, seq_size_per_block):
    """Prefill: store the state after the last prompt token in that token's block."""
    ssm_states[block_ids[cal_block_idx(seq_len, seq_size_per_block)]] = state


# --- models_py/model_desc ---------------------------------------------------------------------------------------------

class PyAttentionInputs:
    def __init__(self):
        self.sequence_lengths_plus_1_d = None
        self.kv_cache_kernel_block_id_device = None
        self.kv_cache_kernel_block_id_device_by_group = None
        self.kv_cache_layer_to_group = [0]                      # host-side: layer 0 -> linear group 0


class PyModelInputs:
    def __init__(self):
        self.input_ids = None
        self.attention_inputs = PyAttentionInputs()

    def by_value(self):
        """The C++ struct as the Python forward receives it through pybind: a copy whose tensors are shared."""
        out = PyModelInputs()
        out.input_ids = self.input_ids
        out.attention_inputs.__dict__.update(self.attention_inputs.__dict__)
        out.attention_inputs.kv_cache_kernel_block_id_device_by_group = list(
            self.attention_inputs.kv_cache_kernel_block_id_device_by_group)
        return out


def select_block_map_for_layer(attention_inputs, layer_idx):
    gid = attention_inputs.kv_cache_layer_to_group[layer_idx]
    attention_inputs.kv_cache_kernel_block_id_device = attention_inputs.kv_cache_kernel_block_id_device_by_group[gid]
    return gid


class Qwen3NextGatedDeltaNetDecode:
    def __init__(self, gen, device):
        r = lambda *s, scale=1.0: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.wq, self.wk, self.wv = r(HIDDEN, K), r(HIDDEN, K), r(HIDDEN, K)
        self.wa, self.wb = r(HIDDEN), r(HIDDEN)
        self.A_log, self.dt_bias = r(1, scale=0.3), r(1, scale=0.3) - 1.0
        self.wo = r(K, HIDDEN, scale=1.5)

    def _gates(self, x):
        g = -torch.exp(self.A_log) * torch.nn.functional.softplus(x @ self.wa + self.dt_bias)
        return g, torch.sigmoid(x @ self.wb)

    def _fla(self, x, ssm_states, attn_inputs):
        g, beta = self._gates(x)
        return fused_recurrent_gated_delta_rule(
            q=x @ self.wq, k=x @ self.wk, v=x @ self.wv, g=g, beta=beta, initial_state=ssm_states,
            inplace_final_state=True, block_map=attn_inputs.kv_cache_kernel_block_id_device,
            seq_size_per_block=SEQ_SIZE_PER_BLOCK, sequence_lengths=attn_inputs.sequence_lengths_plus_1_d)

    def forward(self, x, attn_inputs, ssm_states):
        return x + self._fla(x, ssm_states, attn_inputs) @ self.wo

    def prefill_state(self, x):
        """Eager prefill stand-in: the recurrence over the prompt from a zero state."""
        g, beta = self._gates(x)
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        h = torch.zeros(K, K, dtype=x.dtype, device=x.device)
        for t in range(x.shape[0]):
            h = h * torch.exp(g[t])
            vt = (v[t] - (h * k[t][:, None]).sum(0)) * beta[t]
            h = h + k[t][:, None] * vt[None, :]
        return h


class Qwen3NextModel:
    def __init__(self, device):
        gen = generator(2768)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.layers = [Qwen3NextGatedDeltaNetDecode(gen, device)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).double()
        self.ssm_states = torch.zeros(NUM_BLOCKS, K, K, dtype=torch.float64, device=device)

    def forward(self, inputs):
        h = self.embed_tokens[inputs.input_ids]
        for i, layer in enumerate(self.layers):
            # Switch to correct block_map for this layer in hybrid attention mode
            select_block_map_for_layer(inputs.attention_inputs, i)
            h = layer.forward(h, inputs.attention_inputs, self.ssm_states)
        return h @ self.lm_head


# --- rtp_llm/cpp/cuda/CudaGraph/CudaGraphRunner.cc (its logic, in Python) ---------------------------------------------

def copySmallerIntoLarger(source_tensor, target_tensor):
    rows, cols = source_tensor.shape
    target_tensor[:rows, :cols].copy_(source_tensor)


def make_decode_inputs(reqs, device):
    """The engine's per-step decode inputs (real rows only)."""
    inputs = PyModelInputs()
    inputs.input_ids = torch.tensor([r.last_token for r in reqs]).to(device)
    attn = inputs.attention_inputs
    attn.sequence_lengths_plus_1_d = torch.tensor([r.seq_len + 1 for r in reqs], dtype=torch.int32).to(device)
    table = torch.zeros(len(reqs), MAX_BLOCKS, dtype=torch.int32)
    for i, r in enumerate(reqs):
        table[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
    attn.kv_cache_kernel_block_id_device = table.to(device)
    attn.kv_cache_kernel_block_id_device_by_group = [table.to(device)]
    return inputs


class CudaGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        i32 = dict(dtype=torch.int32, device=device)
        hold = PyModelInputs()                                  # capture_mem_hold_: max-sized buffers
        hold.input_ids = torch.zeros(MAX_BS, dtype=torch.int64, device=device)
        hold.attention_inputs.sequence_lengths_plus_1_d = torch.zeros(MAX_BS, **i32)
        hold.attention_inputs.kv_cache_kernel_block_id_device = torch.zeros(MAX_BS, MAX_BLOCKS, **i32)
        hold.attention_inputs.kv_cache_kernel_block_id_device_by_group = [torch.zeros(MAX_BS, MAX_BLOCKS, **i32)]
        self.capture_mem_hold_ = hold
        self.graph_instances_ = {}
        self.captureDecode()

    def prepareCaptureInputs(self, batch_size):
        h = self.capture_mem_hold_
        inputs = PyModelInputs()
        inputs.input_ids = h.input_ids[:batch_size]
        a, ha = inputs.attention_inputs, h.attention_inputs
        a.sequence_lengths_plus_1_d = ha.sequence_lengths_plus_1_d[:batch_size]
        a.kv_cache_kernel_block_id_device = ha.kv_cache_kernel_block_id_device[:batch_size]
        a.kv_cache_kernel_block_id_device_by_group = [
            t[:batch_size] for t in ha.kv_cache_kernel_block_id_device_by_group]
        return inputs

    def captureDecode(self):
        ha = self.capture_mem_hold_.attention_inputs
        static = {"input_ids": self.capture_mem_hold_.input_ids,
                  "sequence_lengths_plus_1_d": ha.sequence_lengths_plus_1_d,
                  "kv_cache_kernel_block_id_device": ha.kv_cache_kernel_block_id_device,
                  "kv_cache_kernel_block_id_device_by_group[0]": ha.kv_cache_kernel_block_id_device_by_group[0]}
        for bs in sorted(CAPTURE_RANGE, reverse=True):
            inputs = self.prepareCaptureInputs(bs)
            g, out = capture(lambda inputs=inputs: self.model.forward(inputs.by_value()), device=self.device,
                             name=f"decode [{bs}]", owner="CudaGraphRunner", static=static,
                             state={"linear_cache_ssm_states": self.model.ssm_states})
            self.graph_instances_[bs] = (inputs, g, out)

    def prepareInputs(self, inputs, current_batch_size, graph_bs):
        py_model_inputs_ = self.graph_instances_[graph_bs][0]
        dst, src = py_model_inputs_.attention_inputs, inputs.attention_inputs
        # clear kv_cache_kernel_block_id_device, otherwise it will cause the cache block pollution
        dst.kv_cache_kernel_block_id_device.fill_(0)
        py_model_inputs_.input_ids[:current_batch_size].copy_(inputs.input_ids)
        dst.sequence_lengths_plus_1_d[:current_batch_size].copy_(src.sequence_lengths_plus_1_d)
        copySmallerIntoLarger(src.kv_cache_kernel_block_id_device, dst.kv_cache_kernel_block_id_device)
        # Hybrid cache: update per-group block tables (including group 0).
        for g in range(len(src.kv_cache_kernel_block_id_device_by_group)):
            if _variant == "fix":
                # Clear per-group block tables before copying real entries.
                dst.kv_cache_kernel_block_id_device_by_group[g].fill_(0)
            copySmallerIntoLarger(src.kv_cache_kernel_block_id_device_by_group[g],
                                  dst.kv_cache_kernel_block_id_device_by_group[g])

    def forward(self, inputs):
        bs = inputs.input_ids.shape[0]
        graph_bs = next(s for s in sorted(CAPTURE_RANGE) if s >= bs)
        self.prepareInputs(inputs, bs, graph_bs)
        py_model_inputs_, g, out = self.graph_instances_[graph_bs]
        a = py_model_inputs_.attention_inputs
        padded = {"input_ids": py_model_inputs_.input_ids, "sequence_lengths_plus_1_d": a.sequence_lengths_plus_1_d}
        if _variant != "fix":
            padded["kv_cache_kernel_block_id_device_by_group[0]"] = a.kv_cache_kernel_block_id_device_by_group[0]
        return replay(g, out, real=bs, size=graph_bs, padded=padded)[:bs]


# --- the engine (stand-in) --------------------------------------------------------------------------------------------

class Stream:
    def __init__(self, rid, prompt, max_new_tokens):
        self.rid, self.prompt, self.max_new_tokens = rid, list(prompt), max_new_tokens
        self.block_ids, self.outputs = [], []
        self.seq_len = len(prompt) - 1                         # tokens whose state is in the cache
        self.last_token = prompt[-1]


class Engine:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = Qwen3NextModel(device)
        self.free_blocks = list(range(1, NUM_BLOCKS))           # block 0 reserved
        self.runner = CudaGraphRunner(self.model, device) if use_cuda_graph else None

    def prefill(self, s):
        n = -(-(len(s.prompt) + s.max_new_tokens) // SEQ_SIZE_PER_BLOCK)
        s.block_ids = [self.free_blocks.pop() for _ in range(n)]
        x = self.model.embed_tokens[torch.tensor(s.prompt[:-1]).to(self.device)]
        state = self.model.layers[0].prefill_state(x)
        store_ssm_state_to_block_map(self.model.ssm_states, state, s.block_ids, s.seq_len, SEQ_SIZE_PER_BLOCK)

    def release(self, s):
        self.free_blocks.extend(s.block_ids)

    def decode(self, streams):
        inputs = make_decode_inputs(streams, self.device)
        logits = self.runner.forward(inputs) if self.runner is not None else self.model.forward(inputs.by_value())
        for s, row in zip(streams, logits):
            s.outputs.append(row.clone())
            s.last_token, s.seq_len = int(row.argmax()), s.seq_len + 1


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7, 1], "B": [2, 9, 4, 4, 11], "C": [5, 6], "D": [8, 1, 13, 2, 7, 7], "E": [4, 12, 3, 9]}
    max_new = {"A": 6, "B": 6, "C": 6, "D": 2, "E": 3}

    def serve(use_cuda_graph):
        eng = Engine(device, use_cuda_graph)
        streams = {rid: Stream(rid, prompts[rid], max_new[rid]) for rid in "ABCDE"}
        running = []
        for rid in "ABCD":
            eng.prefill(streams[rid])
            running.append(streams[rid])
        for step in range(6):
            if step == 2:
                eng.prefill(streams["E"])                      # admitted into D's freed blocks
            eng.decode(running)
            if step == 2:
                running.append(streams["E"])                   # decodes from the next step on
            for s in list(running):
                if len(s.outputs) >= s.max_new_tokens:
                    running.remove(s)
                    eng.release(s)
        return [torch.stack(streams[rid].outputs) for rid in "ABCDE"]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
