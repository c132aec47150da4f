"""The decode graph is captured right after prefill, before any eager decode: the Triton MLA decode kernel's first launch (JIT load) happens inside the capture.

Upstream: https://github.com/kvcache-ai/ktransformers/pull/301 ("fix-cuda-graph-bug", merged 2025-02-14), commit
https://github.com/kvcache-ai/ktransformers/commit/1946493f2d301769c0da83ac2dd2ecaf1f942093 ("warm_up before capture").
Symptom: not stated upstream (no issue, no error text). The model takes the failure a Triton JIT load gives under
capture: "Triton Error [CUDA]: operation not permitted when stream is capturing" at the decode graph's capture;
eager decode (``use_cuda_graph=False``) works.
Mechanism: hours earlier, #294 ("linux support triton MLA kernel") made ``KDeepseekV2Attention.forward_linux`` decode
(``q_len == 1``) through ``decode_attention_fwd_grouped``, whose Triton kernels (``_fwd_grouped_kernel_stage1``,
``_fwd_kernel_stage2``) compile and load on their first launch (``JITFunction.run`` -> ``_init_handles`` ->
``load_binary`` -> ``cuModuleLoadData``); prefill (``q_len > 1``) takes another path. ``prefill_and_generate``
built ``CUDAGraphRunner()`` right after prefill and called ``capture``, which runs no warmup: it enters
``torch.cuda.graph`` and runs the decode forward for the first time there, so the first launch (and the lazy
``get_absorbed`` set-up) happens inside the capture, and the driver refuses the module load
(cudaErrorStreamCaptureUnsupported). Which first-call work broke the capture is our reading: the PR says only
"warm up before capture"; ``get_absorbed``'s copies inside the capture are replay-safe, the module load is not.
Doctor: sync-in-capture, at decode_attention_fwd_grouped (its Triton kernels' first launch, a module load the driver
refuses during capture, runs inside the first decode capture because no decode ran before it).
Fix (upstream): capture moves into the decode loop: ``if use_cuda_graph and ((warm_uped and i == 1) or (not warm_uped
and i == 2))``, with a module-level ``warm_uped`` flag, so the first generation in the process decodes one token
eagerly before capturing; ``decode_one_tokens`` falls back to eager while ``cuda_graph_runner is None``.
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.engine import CaptureError
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/kvcache-ai/ktransformers/pull/301"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "decode_attention_fwd_grouped"
SYMPTOM = "first decode capture fails: Triton Error [CUDA]: operation not permitted when stream is capturing"

VOCAB, DIM, HEADS, NOPE, V_DIM, RANK, PAGE = 12, 6, 2, 2, 2, 3, 4
MAX_LEN = 16


class JITFunction:
    """A Triton kernel: compiled and loaded (``cuModuleLoadData``) on its first launch in the process."""

    def __init__(self, name, fn, process):
        self.name, self.fn, self.process = name, fn, process

    def _init_handles(self):
        if torch.cuda.is_current_stream_capturing():      # load_binary -> cuModuleLoadData
            raise CaptureError("Triton Error [CUDA]: operation not permitted when stream is capturing "
                               f"(cuModuleLoadData for {self.name})\n  at {user_frame()}",
                               op="cuModuleLoadData", source=user_frame())
        self.process.loaded.add(self.name)

    def run(self, *args):
        if self.name not in self.process.loaded:
            self._init_handles()
        return self.fn(*args)


class Process:
    """What lives as long as the Python process: Triton's loaded kernels and utils.warm_uped."""

    def __init__(self):
        self.loaded, self.warm_uped = set(), False


def _stage1(q, kv, seq_len, attn_logits):
    cols = torch.arange(kv.shape[0], device=q.device)
    scores = torch.einsum("hr,tr->ht", q, kv).masked_fill(cols[None, :] >= seq_len, -1e9)
    attn_logits.copy_(torch.softmax(scores, -1))


def _stage2(attn_logits, kv, attn_output):
    attn_output.copy_(attn_logits @ kv)


def decode_attention_fwd_grouped(kernels, q, compressed_kv, attn_output, seq_len, attn_logits):
    kernels["_fwd_grouped_kernel_stage1"].run(q, compressed_kv, seq_len, attn_logits)
    kernels["_fwd_kernel_stage2"].run(attn_logits, compressed_kv, attn_output)


class StaticCache:
    def __init__(self, device):
        self.kv = torch.zeros(MAX_LEN // PAGE, PAGE, RANK, device=device)
        self.past_tokens = 0

    def update(self, compressed_kv, cache_position):
        self.past_tokens += cache_position.size(0)
        self.kv[cache_position // PAGE, cache_position % PAGE] = compressed_kv
        return self.kv.view(-1, RANK)

    def change_seq_length(self, n):
        self.past_tokens += n


class KDeepseekV2Attention:
    def __init__(self, w, kernels):
        self.w, self.kernels = w, kernels

    def get_absorbed(self):
        if not (hasattr(self, "q_absorb") and hasattr(self, "out_absorb")):
            kv_b_proj = self.w["kv_b_proj"].view(HEADS, NOPE + V_DIM, RANK)
            q_absorb, out_absorb = kv_b_proj[:, :NOPE, :].reshape(-1, RANK), kv_b_proj[:, NOPE:, :].reshape(-1, RANK)
            self.q_absorb = nn.Linear(RANK, HEADS * NOPE, bias=False, device=q_absorb.device)
            self.q_absorb.weight.data = q_absorb
            self.out_absorb = nn.Linear(RANK, HEADS * V_DIM, bias=False, device=out_absorb.device)
            self.out_absorb.weight.data = out_absorb
        return self.q_absorb.weight.view(HEADS, NOPE, RANK), self.out_absorb.weight.view(HEADS, V_DIM, RANK)

    def forward_linux(self, hidden_states, cache_position, past_key_value):
        q_nope = (hidden_states @ self.w["q_proj"]).view(-1, HEADS, NOPE)
        compressed_kv = hidden_states @ self.w["kv_a_proj"]
        if hidden_states.shape[0] == 1:                           # decode: absorbed MLA through Triton
            kv = past_key_value.update(compressed_kv, cache_position)
            q_absorb, out_absorb = self.get_absorbed()
            q = torch.einsum("thn,hnr->thr", q_nope, q_absorb)[0]
            attn_output = torch.zeros(HEADS, RANK, device=q.device)
            attn_logits = torch.empty(HEADS, MAX_LEN, device=q.device)
            decode_attention_fwd_grouped(self.kernels, q, kv, attn_output, cache_position + 1, attn_logits)
            return torch.einsum("hr,hvr->hv", attn_output, out_absorb).reshape(1, -1) @ self.w["o_proj"]
        past_key_value.update(compressed_kv, cache_position)      # prefill: the unabsorbed path
        kv_b = self.w["kv_b_proj"].view(HEADS, NOPE + V_DIM, RANK)
        k = torch.einsum("tr,hnr->htn", compressed_kv, kv_b[:, :NOPE])
        v = torch.einsum("tr,hvr->htv", compressed_kv, kv_b[:, NOPE:])
        causal = torch.ones(len(cache_position), len(cache_position), dtype=torch.bool, device=k.device).tril()
        s = torch.einsum("thn,hsn->hts", q_nope, k).masked_fill(~causal, -1e9)
        return torch.einsum("hts,hsv->thv", torch.softmax(s, -1), v).reshape(len(cache_position), -1) @ self.w["o_proj"]


class Model:
    def __init__(self, w, process):
        kernels = {n: JITFunction(n, f, process) for n, f in (("_fwd_grouped_kernel_stage1", _stage1),
                                                               ("_fwd_kernel_stage2", _stage2))}
        self.w, self.self_attn = w, KDeepseekV2Attention(w, kernels)

    def embed_tokens(self, ids):
        return self.w["emb"][ids]

    def __call__(self, inputs_embeds, cache_position, past_key_values):
        h = inputs_embeds + self.self_attn.forward_linux(inputs_embeds, cache_position, past_key_values)
        return h @ self.w["lm_head"]


class CUDAGraphRunner:
    def capture(self, model, cur_token, cache_position, past_key_values, device):
        self.model = model
        inputs_embeds = model.embed_tokens(cur_token)
        self.graph, logits = capture(lambda: model(inputs_embeds, cache_position, past_key_values), device=device,
                                     warmups=0, owner="CUDAGraphRunner", state={"StaticCache.kv": past_key_values.kv},
                                     static={"inputs_embeds": inputs_embeds, "cache_position": cache_position})
        past_key_values.change_seq_length(-1)
        self.input_buffers = {"inputs_embeds": inputs_embeds, "cache_position": cache_position}
        self.output_buffers = {"logits": logits}

    def __call__(self, cur_token, cache_position):
        self.input_buffers["inputs_embeds"].copy_(self.model.embed_tokens(cur_token))
        self.input_buffers["cache_position"].copy_(cache_position)
        return replay(self.graph, self.output_buffers["logits"])


def prefill_and_generate(model, process, inputs, max_new_tokens, use_cuda_graph, variant, device):
    past_key_values = StaticCache(device)

    def decode_one_tokens(cuda_graph_runner, cur_token, cache_position, use_cuda_graph):
        if variant == "fix" and cuda_graph_runner is None:
            use_cuda_graph = False
        if use_cuda_graph:
            logits = cuda_graph_runner(cur_token, cache_position)
        else:
            logits = model(model.embed_tokens(cur_token), cache_position, past_key_values)
        past_key_values.change_seq_length(1)
        return logits.argmax(-1), logits.clone()

    seq_length = len(inputs)
    cache_position = torch.arange(seq_length, device=device)
    logits = model(model.embed_tokens(torch.tensor(inputs, device=device)), cache_position, past_key_values)
    next_token, outs = logits[-1:].argmax(-1), [logits[-1:].clone()]
    cache_position = torch.tensor([seq_length], device=device)
    cuda_graph_runner = None
    if variant == "bug" and use_cuda_graph:                        # capture right after prefill
        cuda_graph_runner = CUDAGraphRunner()
        cuda_graph_runner.capture(model, next_token, cache_position, past_key_values, device)
    for i in range(1, max_new_tokens):
        warm = (process.warm_uped and i == 1) or (not process.warm_uped and i == 2)
        if variant == "fix" and use_cuda_graph and warm:
            process.warm_uped = True
            cuda_graph_runner = CUDAGraphRunner()
            cuda_graph_runner.capture(model, next_token, cache_position, past_key_values, device)
        next_token, logits = decode_one_tokens(cuda_graph_runner, next_token, cache_position, use_cuda_graph)
        outs.append(logits)
        cache_position += 1
    return outs


def run(variant: str, device: str = "cpu"):
    gen = generator(301)
    w = {"emb": randn(VOCAB, DIM, gen=gen, device=device), "q_proj": randn(DIM, HEADS * NOPE, gen=gen, device=device),
         "kv_a_proj": randn(DIM, RANK, gen=gen, device=device),
         "kv_b_proj": randn(HEADS * (NOPE + V_DIM), RANK, gen=gen, device=device),
         "o_proj": randn(HEADS * V_DIM, DIM, gen=gen, device=device, scale=0.5),
         "lm_head": randn(DIM, VOCAB, gen=gen, device=device)}

    def serve(graphed: bool):
        process = Process()                                       # one local_chat process: two generations
        model, outs = Model(w, process), []
        for prompt in ([3, 7, 1], [5, 2, 8, 6]):
            outs += prefill_and_generate(model, process, prompt, 5, graphed, variant, device)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
