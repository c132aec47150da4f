"""TransformerEngine KV-cache inference with CUDA graphs (the TE Gemma generation tutorial): ``MultiheadAttention``
slices the RoPE table at ``inference_params.get_seqlens_pre_step()``, a tensor that ``get_seqlens_pre_step`` builds on
the host from the Python ``sequences_pre_step`` dict at every call. Inside the recorded generation graph that slice
offset is computed once, at capture, so every replayed decode step rotates queries and keys at the capture-time
position instead of the token's real position.

Upstream: https://github.com/NVIDIA/TransformerEngine/pull/1839 ("TE Gemma tutorial attempt#2",
NVIDIA/TransformerEngine, by sudhakarsingh27 (Sudhakar Singh), reviewed by cyanguwa; squash-merged to main as commit
7042d7ae6, 2025-09-16, whose commit log lists "make cuda graphs work with non-paged and paged attention"; the stored
PR thread still shows it open at crawl time, the commit is on main). Read: the commit's hunks of
``transformer_engine/pytorch/attention/inference.py`` (``InferenceParams.__init__`` gains the static
``pre_step_seqlens`` buffer; ``pre_step`` copies the pre-step sequence lengths into it; ``get_seqlens_pre_step``
returns it instead of ``torch.Tensor(list(self.sequences_pre_step.values())).to(dtype=torch.int32, device="cpu")``;
``NonPagedKVCacheManager.pre_step`` batch-index copy) and of ``attention/multi_head_attention.py``
(``MultiheadAttention.forward`` drops ``q_pos_emb[sequence_start:sequence_end]`` and passes
``start_positions=sequence_start_positions`` to the fused ``apply_rotary_pos_emb``); at the parent commit:
``inference.py`` whole (``InferenceParams``, ``NonPagedKVCacheManager.pre_step`` / ``step`` with
``copy_to_kv_cache``), the rotary block of ``MultiheadAttention.forward``, ``attention/rope.py``
(``apply_rotary_pos_emb``, ``_apply_rotary_pos_emb_base`` and the ``start_positions`` contract); at the merge commit:
``docs/examples/te_gemma/te_gemma.py`` whole (``GemmaModelWrapper``, ``GemmaGenerationWrapper``,
``TEGemmaForCausalLM.generate`` / ``setup_and_run_context_phase``, ``TEGemmaForCausalLMCudaGraphs.record`` /
``record_graph`` with ``te.pytorch.make_graphed_callables(..., num_warmup_iters=5)``), and the review thread quoting
the ``pre_step`` hunk. Not read: ``graph.py`` (``make_graphed_callables`` is reduced to warm up, capture, copy-in,
replay), the CUDA RoPE and ``copy_to_kv_cache`` kernels (replaced by torch ops of the same contract).
Symptom: no user report; the commit itself says it makes "cuda graphs work with non-paged and paged attention" and
adds the graphed tutorial with it. As modelled (the tutorial's runner on the parent commit's library code): generation
with ``TEGemmaForCausalLMCudaGraphs`` (graphs recorded at init) returns tokens that differ from the same model run
eagerly, because every decode replay applies RoPE at the position the generation graph was recorded with
(``record`` warms the cache with a 9-token context, so position 9), whatever the prompt length and step.
Mechanism: ``InferenceParams.pre_step`` runs on the host before each step and only updates Python dicts and the
device ``cu_seqlens`` buffers. ``MultiheadAttention.forward`` (inside the recorded callable) calls
``get_seqlens_pre_step()``, which turns ``sequences_pre_step`` into a host tensor, and slices
``q_pos_emb[sequence_start:sequence_end]``: the slice start becomes a Python integer at capture, the captured RoPE
kernels read a fixed window of the table, and replays never see the new ``sequences_pre_step``. KV-cache writes and the
attention masks read the device ``cu_seqlens`` buffers and stay right; only the rotation is frozen, so keys are cached
with the wrong rotation as well. Eager re-runs the host code each step and is right.
Doctor: host-work-frozen, at get_seqlens_pre_step. The start positions are host work done inside the captured region
(a tensor built from a Python dict and used as a slice bound), so replays keep the capture-time value; the fix makes
``get_seqlens_pre_step`` return a static device buffer that ``pre_step`` refreshes outside the graph.
Fix (upstream): ``InferenceParams`` owns ``pre_step_seqlens`` (int32, ``max_batch_size``), ``pre_step`` copies the
pre-step lengths into it, ``get_seqlens_pre_step`` returns it, and ``MultiheadAttention.forward`` passes it as
``start_positions`` to the fused RoPE, which offsets every sequence on the device.
Modelled: ``InferenceParams`` (``pre_step``, ``get_seqlens_pre_step``, ``step``, static ``cu_seqlens_q/kv``),
``NonPagedKVCacheManager`` (``pre_step`` advancing unfinished sequences by one, ``step`` as ``copy_to_kv_cache`` into
per-layer ``[b, max_seqlen, h, d]`` caches), ``RotaryPositionEmbedding`` and the fused ``apply_rotary_pos_emb`` with
``start_positions``, ``MultiheadAttention.forward``'s rotary block, ``GemmaModelWrapper`` / ``GemmaGenerationWrapper``
with their static in-place copies, ``TEGemmaForCausalLM.generate`` and ``TEGemmaForCausalLMCudaGraphs.record`` /
``record_graph`` (hard-coded 9-token context, then one-token generation ``pre_step``, 5 warmup iterations;
``make_graphed_callables`` reduced to ``_GraphedCallable``: warm up, capture, copy into the static input, replay).
Stand-ins: two tiny attention+MLP layers with RMSNorm instead of the HF-patched ``TEGemmaDecoderLayer``, masked torch
attention over the cache instead of fused attention (reading no slot past a sequence's cached length, as the
kernel does: the slots the dummy context warmups wrote from the uninitialised buffer stay unread), no FP8, no re-indexing of finished sequences (one sequence),
the caches of the graphed model allocated in its constructor (upstream: at the first warmup call), float64.
Batch size 1: the parent commit's slice also fails eagerly for more than one sequence (a tensor of several elements as
a slice bound), so the graph-only failure is the one-sequence case.
Workload: static batch 1, ``cuda_graphs_static_max_context_len`` 16, one prompt of 5 tokens right-padded to 16,
``max_new_tokens`` 6 (7 generated tokens: one from the context phase, six from generation replays); the eager
reference is ``TEGemmaForCausalLM`` on the same prompt and weights.
Measured: bug: misbehaves, max |graph - eager| = 7 over the returned token ids: the context-phase token and the
first generation replay agree (5, 5), then the graphed run repeats 5 (5 5 5 5 5) where eager gives 11 6 12 11 6
(decode positions 5..10 rotated at the frozen position 9); fix: equals eager (max 0), same 7 generated tokens.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TransformerEngine/pull/1839"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "get_seqlens_pre_step"
SYMPTOM = ("CUDA-graphed TE generation rotates every decode step's queries and keys at the capture-time position, "
           "because the RoPE start comes from host-built pre-step lengths frozen in the graph")

VOCAB, HIDDEN, HEADS, HEAD_DIM, FFN, NUM_LAYERS = 16, 8, 2, 4, 16, 2
MAX_POSITION_EMBEDDINGS = 32
CUDA_GRAPHS_STATIC_BATCH_SIZE, CUDA_GRAPHS_STATIC_MAX_CONTEXT_LEN = 1, 16
DTYPE = torch.float64

_variant = "bug"


# --- transformer_engine/pytorch/attention/inference.py (reduced) -----------------------------------------------------

class NonPagedKVCacheManager:
    def __init__(self, max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, device):
        self.max_batch_size, self.max_seqlen = max_batch_size, max_seqlen
        self.num_heads, self.head_dim_k, self.dtype, self.device = num_heads, head_dim_k, dtype, device
        self.sequences = OrderedDict()
        self.cache = {}

    def reset(self):
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number):
        shape = (self.max_batch_size, self.max_seqlen, self.num_heads, self.head_dim_k)
        self.cache[layer_number] = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                                    torch.zeros(shape, dtype=self.dtype, device=self.device))

    def pre_step(self, step_dict):
        unfinished_seqs = self.sequences.keys() & step_dict.keys()
        finished_seqs = self.sequences.keys() - unfinished_seqs
        for i in unfinished_seqs:                      # advance unfinished sequences
            self.sequences[i] += 1
        for i in finished_seqs:
            self.sequences.pop(i)
        for i in step_dict.keys() - self.sequences.keys():
            self.sequences[i] = step_dict[i]
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        """``tex.copy_to_kv_cache``: token t < new_len of sequence b goes to slot cached_len - new_len + t."""
        k_cache, v_cache = self.cache[layer_number]
        batch_size, ctx_len = new_k.shape[0], new_k.shape[1]
        new_lens = (cu_new_seqlens[1:batch_size + 1] - cu_new_seqlens[:batch_size]).long()
        cached_lens = (cu_cached_seqlens[1:batch_size + 1] - cu_cached_seqlens[:batch_size]).long()
        t = torch.arange(ctx_len, device=new_k.device)
        valid = t[None, :] < new_lens[:, None]
        slot = (cached_lens - new_lens)[:, None] + t[None, :]
        slot = torch.where(valid, slot, torch.full_like(slot, self.max_seqlen - 1))
        b = torch.arange(batch_size, device=new_k.device)[:, None].expand(batch_size, ctx_len)
        keep = valid[..., None, None]
        k_cache.index_put_((b, slot), torch.where(keep, new_k, k_cache[b, slot]))
        v_cache.index_put_((b, slot), torch.where(keep, new_v, v_cache[b, slot]))
        return k_cache[:batch_size], v_cache[:batch_size]


class InferenceParams:
    def __init__(self, max_batch_size, max_sequence_length, num_heads_kv, head_dim_k, dtype, device,
                 qkv_format="bshd"):
        self.max_batch_size, self.max_sequence_length, self.device = max_batch_size, max_sequence_length, device
        self.cache_manager = NonPagedKVCacheManager(max_batch_size, max_sequence_length, num_heads_kv, head_dim_k,
                                                    dtype, device)
        self.input_qkv_format = qkv_format
        self.sequences_pre_step = OrderedDict()
        self.sequences = OrderedDict()
        self.batch_size = 0
        i32 = dict(dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_batch_size + 1, **i32)
        self.cu_seqlens_kv = torch.zeros(max_batch_size + 1, **i32)
        if _variant == "fix":
            # running length of each unfinished sequence before the step, refreshed in pre_step()
            self.pre_step_seqlens = torch.zeros(max_batch_size, **i32)

    def reset(self):
        self.sequences = OrderedDict()
        self.cache_manager.reset()

    def allocate_memory(self, layer_number):
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict):
        self.batch_size = len(step_dict)
        self.sequences = self.cache_manager.pre_step(step_dict)
        self.sequences_pre_step = OrderedDict()
        for k, v in self.sequences.items():
            self.sequences_pre_step[k] = v - step_dict[k]

        if _variant == "fix":
            pre_step_seqlens_temp = host(torch.tensor(list(self.sequences_pre_step.values()), dtype=torch.int32),
                                         self.device)
            self.pre_step_seqlens[: len(pre_step_seqlens_temp)].copy_(pre_step_seqlens_temp)

        seqlens_q = list(step_dict.values())
        cu_seqlens_q = [0] + [sum(seqlens_q[:i]) for i in range(1, self.batch_size + 1)]
        cu_seqlens_q = cu_seqlens_q + [cu_seqlens_q[-1]] * (self.max_batch_size - self.batch_size)
        self.cu_seqlens_q.copy_(host(torch.tensor(cu_seqlens_q, dtype=torch.int32), self.device))
        seqlens_kv = list(self.sequences.values())
        cu_seqlens_kv = [0] + [sum(seqlens_kv[:i]) for i in range(1, self.batch_size + 1)]
        cu_seqlens_kv = cu_seqlens_kv + [cu_seqlens_kv[-1]] * (self.max_batch_size - self.batch_size)
        self.cu_seqlens_kv.copy_(host(torch.tensor(cu_seqlens_kv, dtype=torch.int32), self.device))

    def get_seqlens_pre_step(self):
        """Get cached sequence lengths before the stepping"""
        if _variant == "bug":
            return host(torch.tensor(list(self.sequences_pre_step.values()), dtype=torch.int32), self.device)
        return self.pre_step_seqlens

    def step(self, layer_number, new_k, new_v, qkv_format):
        k_cache, v_cache = self.cache_manager.step(layer_number, new_k, new_v, self.cu_seqlens_q, self.cu_seqlens_kv,
                                                   qkv_format)
        return k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_kv


# --- transformer_engine/pytorch/attention/rope.py (reduced) ----------------------------------------------------------

class RotaryPositionEmbedding:
    def __init__(self, dim, rotary_base=10000.0, device="cpu"):
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=DTYPE, device=device) / dim))

    def __call__(self, max_seq_len):
        seq = torch.arange(max_seq_len, dtype=DTYPE, device=self.inv_freq.device)
        freqs = torch.einsum("i , j -> i j", seq, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1).reshape(max_seq_len, 1, 1, -1)


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs, tensor_format="bshd", start_positions=None, fused=True):
    """Fused RoPE (bshd): token s of sequence b is rotated by ``freqs[start_positions[b] + s]`` (no offset when
    ``start_positions`` is None); the kernel reads ``start_positions`` on the device."""
    b, s = t.shape[0], t.shape[1]
    pos = torch.arange(s, device=t.device)[None, :].expand(b, s)
    if start_positions is not None:
        pos = pos + start_positions[:b, None].long()
    f = freqs.reshape(freqs.shape[0], -1)[pos][:, :, None, :]        # [b, s, 1, d]
    return t * torch.cos(f) + _rotate_half(t) * torch.sin(f)


# --- TE TransformerLayer / MultiheadAttention (reduced) --------------------------------------------------------------

class TEGemmaDecoderLayer:
    def __init__(self, layer_number, gen, device):
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.layer_number = layer_number
        self.qkv_format = "bshd"
        self.wq, self.wk, self.wv = (r(HIDDEN, HEADS * HEAD_DIM) for _ in range(3))
        self.wo = r(HEADS * HEAD_DIM, HIDDEN)
        self.fc1, self.fc2 = r(HIDDEN, FFN), r(FFN, HIDDEN)

    @staticmethod
    def _rmsnorm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _self_attention(self, hidden_states, inference_params, rotary_pos_emb, attn_mask_type):
        """``MultiheadAttention.forward``: qkv, RoPE, KV caching (``DotProductAttention`` with ``inference_params``)."""
        b, s = hidden_states.shape[0], hidden_states.shape[1]
        x = self._rmsnorm(hidden_states)
        query_layer = (x @ self.wq).view(b, s, HEADS, HEAD_DIM)
        key_layer = (x @ self.wk).view(b, s, HEADS, HEAD_DIM)
        value_layer = (x @ self.wv).view(b, s, HEADS, HEAD_DIM)

        if self.layer_number not in inference_params.cache_manager.cache:
            inference_params.allocate_memory(self.layer_number)

        q_pos_emb, k_pos_emb = rotary_pos_emb, rotary_pos_emb
        if _variant == "bug":
            # adjust key and value for inference
            sequence_length = key_layer.size(1)
            sequence_start = inference_params.get_seqlens_pre_step()
            sequence_end = sequence_start + sequence_length
            q_pos_emb = q_pos_emb[sequence_start:sequence_end, ...]
            k_pos_emb = k_pos_emb[sequence_start:sequence_end, ...]
            sequence_start_positions = None
        else:
            # Applying RoPE for inference needs start positions of sequences for each iteration.
            sequence_start_positions = inference_params.get_seqlens_pre_step()
        query_layer = apply_rotary_pos_emb(query_layer, q_pos_emb, self.qkv_format, fused=True,
                                           start_positions=sequence_start_positions)
        key_layer = apply_rotary_pos_emb(key_layer, k_pos_emb, self.qkv_format, fused=True,
                                         start_positions=sequence_start_positions)

        k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv = inference_params.step(
            self.layer_number, key_layer, value_layer, self.qkv_format)
        seqlens_q = (cu_seqlens_q[1:b + 1] - cu_seqlens_q[:b]).long()
        seqlens_kv = (cu_seqlens_kv[1:b + 1] - cu_seqlens_kv[:b]).long()
        i = torch.arange(s, device=x.device)
        j = torch.arange(k_cache.shape[1], device=x.device)
        visible = j[None, None, :] < seqlens_kv[:, None, None]                          # padding
        if attn_mask_type == "padding_causal":
            visible = visible & (j[None, None, :] <= (seqlens_kv - seqlens_q)[:, None, None] + i[None, :, None])
        scores = torch.einsum("bshd,bthd->bhst", query_layer, k_cache) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        # the fused kernel reads no cache slot past each sequence's cached length
        v_cache = torch.where((j[None, :] < seqlens_kv[:, None])[:, :, None, None], v_cache, torch.zeros_like(v_cache))
        context = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v_cache).reshape(b, s, HEADS * HEAD_DIM)
        return context @ self.wo

    def __call__(self, hidden_states, inference_params=None, rope_emb=None, self_attn_mask_type="padding"):
        h = hidden_states + self._self_attention(hidden_states, inference_params, rope_emb, self_attn_mask_type)
        return (h + torch.nn.functional.gelu(self._rmsnorm(h) @ self.fc1) @ self.fc2,)


class GemmaModel:
    def __init__(self, device):
        gen = generator(1839)
        self.embed_weight = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [TEGemmaDecoderLayer(i + 1, gen, device) for i in range(NUM_LAYERS)]
        self.lm_head_weight = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.7).to(DTYPE)

    def embed_tokens(self, ids):
        return self.embed_weight[ids]

    def norm(self, x):
        return TEGemmaDecoderLayer._rmsnorm(x)

    def lm_head(self, x):
        return x @ self.lm_head_weight


# --- docs/examples/te_gemma/te_gemma.py (reduced) --------------------------------------------------------------------

class GemmaModelWrapper:
    def __init__(self, model):
        self.model = model
        self.normalizer = HIDDEN ** 0.5

    def set_inference_params(self, inference_params):
        self.inference_params = inference_params

    def __call__(self, hidden_states, attention_mask=None, attn_mask_type="padding_causal", rope_emb=None):
        hidden_states.data[:] = hidden_states.data[:] * self.normalizer              # static operation
        for decoder_layer in self.model.layers:
            hidden_states.data[:] = decoder_layer(hidden_states, inference_params=self.inference_params,
                                                  rope_emb=rope_emb, self_attn_mask_type=attn_mask_type)[0]
        hidden_states.copy_(self.model.norm(hidden_states))
        return self.model.lm_head(hidden_states)


class GemmaGenerationWrapper:
    def __init__(self, model):
        self.model = model
        self.gemma_layers = GemmaModelWrapper(model)

    def set_inference_params(self, inference_params):
        self.inference_params = inference_params
        self.gemma_layers.set_inference_params(inference_params)

    def __call__(self, hidden_states, mask=None, attn_mask_type="padding", rope_emb=None):
        logits = self.gemma_layers(hidden_states, attention_mask=mask, attn_mask_type=attn_mask_type,
                                   rope_emb=rope_emb)
        logits = logits[:, -1, :]
        next_tokens = torch.argmax(logits, dim=1)
        hidden_states.copy_(self.model.embed_tokens(next_tokens).unsqueeze(1))    # static copy for CUDA graphs
        return next_tokens


class TEGemmaForCausalLM:
    def __init__(self, device):
        self.device = device
        self.model = GemmaModel(device)
        self._model_context_phase = GemmaModelWrapper(self.model)
        self._model_generation_phase = GemmaGenerationWrapper(self.model)
        # reused by all layers (and CUDA graphs)
        self.te_rope_emb = RotaryPositionEmbedding(HEAD_DIM, device=device)(max_seq_len=MAX_POSITION_EMBEDDINGS)

    def _create_or_fetch_hidden_states_buffer(self, input_ids):
        return torch.empty((input_ids.shape[0], input_ids.shape[1], HIDDEN), dtype=DTYPE, device=self.device)

    def _create_or_fetch_inference_params(self, **kwargs):
        return InferenceParams(**kwargs)

    @staticmethod
    def _get_generation_buffer(hidden_states_buffer, data_to_copy=None):
        output = hidden_states_buffer.view(-1)[: hidden_states_buffer.shape[0] * hidden_states_buffer.shape[2]]
        if data_to_copy is not None:
            output.copy_(data_to_copy.reshape(-1))
        return output.view((hidden_states_buffer.shape[0], 1, hidden_states_buffer.shape[2]))

    def setup_and_run_context_phase(self, input_ids, inference_params):
        hidden_states = self._create_or_fetch_hidden_states_buffer(input_ids)
        hidden_states.copy_(self.model.embed_tokens(input_ids))
        lengths = input_ids.ne(0).sum(dim=1)
        inference_params.pre_step(OrderedDict(zip(list(range(len(lengths))), lengths.tolist())))
        logits = self._model_context_phase(hidden_states, attention_mask=None, attn_mask_type="padding_causal",
                                           rope_emb=self.te_rope_emb)
        logits = logits[torch.arange(logits.size(0)), lengths - 1, :]
        next_tokens = torch.argmax(logits, dim=1)
        hidden_states = self._get_generation_buffer(hidden_states, self.model.embed_tokens(next_tokens))
        return hidden_states, next_tokens

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens=0):
        batch_size = input_ids.shape[0]
        inference_params = self._create_or_fetch_inference_params(
            max_batch_size=batch_size, max_sequence_length=CUDA_GRAPHS_STATIC_MAX_CONTEXT_LEN, num_heads_kv=HEADS,
            head_dim_k=HEAD_DIM, dtype=DTYPE, device=self.device)
        self._model_context_phase.set_inference_params(inference_params)
        self._model_generation_phase.set_inference_params(inference_params)

        hidden_states, next_tokens = self.setup_and_run_context_phase(input_ids, inference_params)

        lengths_tensor = torch.ones((next_tokens.shape[0],), dtype=int)
        inference_params.pre_step(OrderedDict(zip(list(range(len(lengths_tensor))), lengths_tensor.tolist())))
        output_tokens = [next_tokens]
        for _ in range(max_new_tokens):
            next_tokens = self._model_generation_phase(hidden_states, mask=None, attn_mask_type="padding",
                                                       rope_emb=self.te_rope_emb)
            lengths_tensor = torch.ones((next_tokens.shape[0],), dtype=int)
            inference_params.pre_step(OrderedDict(zip(list(range(len(lengths_tensor))), lengths_tensor.tolist())))
            output_tokens.append(next_tokens.clone())      # static output: clone, it changes every iteration
        return torch.cat((input_ids, torch.stack(output_tokens).permute([1, 0])), dim=1)


class _GraphedCallable:
    """``make_graphed_callables`` on a module, reduced: the module whose forward copies the user's tensor into the
    static input surface and replays (its other attributes stay the module's)."""

    def __init__(self, module, graph, static_input, static_output):
        self.module, self.graph, self.static_input, self.static_output = module, graph, static_input, static_output

    def __getattr__(self, name):
        return getattr(self.module, name)

    def __call__(self, hidden_states, **kwargs):
        if hidden_states.data_ptr() != self.static_input.data_ptr():
            self.static_input.copy_(hidden_states)
        return replay(self.graph, self.static_output)


class TEGemmaForCausalLMCudaGraphs(TEGemmaForCausalLM):
    def __init__(self, device):
        super().__init__(device)
        self.hidden_states_buffer = torch.empty(
            (CUDA_GRAPHS_STATIC_BATCH_SIZE, CUDA_GRAPHS_STATIC_MAX_CONTEXT_LEN, HIDDEN), dtype=DTYPE, device=device)
        self.generation_buffer = self._get_generation_buffer(self.hidden_states_buffer)
        self.inference_params = InferenceParams(
            max_batch_size=CUDA_GRAPHS_STATIC_BATCH_SIZE, max_sequence_length=CUDA_GRAPHS_STATIC_MAX_CONTEXT_LEN,
            num_heads_kv=HEADS, head_dim_k=HEAD_DIM, dtype=DTYPE, device=device)
        for layer in self.model.layers:                # allocated up front so that the capture can name the caches
            self.inference_params.allocate_memory(layer.layer_number)
        self._model_generation_phase.set_inference_params(self.inference_params)
        self._model_context_phase.set_inference_params(self.inference_params)

    def record(self):
        # context/prefill phase: hard-coded context length
        lengths = torch.tensor([9] * CUDA_GRAPHS_STATIC_BATCH_SIZE, dtype=torch.int32)
        self.inference_params.pre_step(OrderedDict(zip(list(range(len(lengths))), lengths.tolist())))
        self._model_context_phase = self.record_graph(self._model_context_phase, self.hidden_states_buffer,
                                                      "context", attn_mask_type="padding_causal",
                                                      rope_emb=self.te_rope_emb)
        # generation phase
        lengths = torch.tensor(CUDA_GRAPHS_STATIC_BATCH_SIZE * [1], dtype=torch.int32)
        self.inference_params.pre_step(OrderedDict(zip(list(range(len(lengths))), lengths.tolist())))
        self._model_generation_phase = self.record_graph(self._model_generation_phase, self.generation_buffer,
                                                         "generation", attn_mask_type="padding",
                                                         rope_emb=self.te_rope_emb)

    def _create_or_fetch_hidden_states_buffer(self, *args, **kwargs):
        return self.hidden_states_buffer

    def _create_or_fetch_inference_params(self, *args, **kwargs):
        self.inference_params.reset()
        return self.inference_params

    @torch.no_grad()
    def record_graph(self, function, input_tensor, phase, **sample_kwargs):
        params = self.inference_params
        static = {"hidden_states": input_tensor, "cu_seqlens_q": params.cu_seqlens_q,
                  "cu_seqlens_kv": params.cu_seqlens_kv}
        if _variant == "fix":
            static["pre_step_seqlens"] = params.pre_step_seqlens
        state = {}
        for n, (k, v) in params.cache_manager.cache.items():
            state[f"k_cache[{n}]"], state[f"v_cache[{n}]"] = k, v
        g, out = capture(lambda: function(input_tensor, **sample_kwargs), device=str(self.device), warmups=5,
                         static=static, state=state, owner="make_graphed_callables", name=f"TE Gemma {phase} graph")
        return _GraphedCallable(function, g, input_tensor, out)


def _prompt(device):
    ids = torch.zeros(CUDA_GRAPHS_STATIC_BATCH_SIZE, CUDA_GRAPHS_STATIC_MAX_CONTEXT_LEN, dtype=torch.long)
    ids[0, :5] = torch.tensor([3, 11, 7, 2, 14])                       # right-padded with pad_token_id 0
    return ids.to(device)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    max_new_tokens = 6

    def served():
        model = TEGemmaForCausalLMCudaGraphs(device)
        model.record()
        return [model.generate(_prompt(device), max_new_tokens=max_new_tokens).to(DTYPE)]

    def eager():
        model = TEGemmaForCausalLM(device)
        return [model.generate(_prompt(device), max_new_tokens=max_new_tokens).to(DTYPE)]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
