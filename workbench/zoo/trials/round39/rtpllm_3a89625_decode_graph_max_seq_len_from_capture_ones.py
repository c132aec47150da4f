"""rtp-llm's decode graph keeps the TRT-LLM decode kernel's ``max_seq_len`` planned from the capture's dummy lengths of 1.

Upstream: https://github.com/alibaba/rtp-llm/commit/3a89625f30c805d39b2c4445bceb6d0600e04174 ("fix: cuda graph
capture seq len max", Feb 2026, on ``main``).
Symptom: not stated in the commit. The host argument it feeds is documented by FlashInfer as an upper bound that
"must be at least max(seq_lens)" and that picks the KV split, reduction and kernel (flashinfer#5180, for #4647,
where a different value already changes eager-vs-graph bits); here the frozen bound is 2 while the served
sequences are longer.
Mechanism: ``CudaGraphRunner::initCaptureAttentionInputs`` builds the capture's decode inputs with
``sequence_lengths = torch::ones({max_bs_})`` (pinned host memory). The attention object of each graph instance
is made once, from those inputs (``py_attn_pyobj_method_`` -> ``FlashInferTRTLLMDecodeImpl.__init__`` ->
``FlashInferTRTLLMDecodeOp.prepare``), and ``prepare`` turns them into the host scalar
``max_seq_len = sequence_lengths.max().item() + 1`` = 2. The captured ``trtllm_batch_decode_with_kv_cache``
launch keeps it: the launcher derives its KV split (``numCtasPerSeqKv``, ``seqLenPerCtaKv``) from it on the host.
Before every replay ``prepareInputs`` copies the real lengths and calls ``prepare_cuda_graph``, which runs
``prepare`` again but copies back only ``seq_lens``: the new ``max_seq_len`` is dropped. An eager step plans with
its real maximum. In this model the kernel's CTAs cover ``numCtasPerSeqKv * seqLenPerCtaKv`` keys of each
sequence, so a replay attends only to the first 4 cached tokens of every request. The truncation is this model's
reading of a contract violation whose exact effect inside the closed trtllm-gen cubins was not read.
Doctor: warmup-divergence, at ``prepare`` (the KV plan ``max_seq_len`` decided from the capture's dummy
``sequence_lengths`` and reused by every replay).
Fix (upstream): ``initCaptureAttentionInputs`` adds
``sequence_lengths.fill_(max_seq_len_ - num_tokens_per_bs - 1)``, so the plan frozen at capture covers the longest
sequence the runner can serve. (Diff read: the one-line hunk; the consumer read in ``trtllm_gen.py`` at that
commit, and the host plan in FlashInfer's ``fmhaKernels.cuh``.)
"""
from __future__ import annotations

import math

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/3a89625f30c805d39b2c4445bceb6d0600e04174"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "prepare"
SYMPTOM = "decode replays attend only to the KV range planned for capture-time sequence length 1"

VOCAB, DIM = 16, 8
SEQ_SIZE_PER_BLOCK, MAX_SEQ_LEN, MAX_BS = 4, 32, 2
MAX_BLOCKS = MAX_SEQ_LEN // SEQ_SIZE_PER_BLOCK + 1
NUM_BLOCKS = 1 + MAX_BS * MAX_BLOCKS           # block 0: the dummy block capture inputs point at
STEP_KV, MAX_CTAS_KV = 4, 4                    # the kernel's KV step; CTAs available per sequence


class PyAttentionInputs:
    def __init__(self):
        self.is_prefill = False
        self.input_lengths = None
        self.sequence_lengths = None           # [bs] int32, pinned host memory: tokens already cached
        self.kv_cache_block_id_device = None   # [bs, max_blocks] int32


class PyModelInputs:
    def __init__(self):
        self.input_ids = None
        self.attention_inputs = PyAttentionInputs()


class FlashInferTRTLLMParams:
    def __init__(self, batch_size, max_seq_len=0, seq_lens=None, block_tables=None):
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len  # for decode
        self.seq_lens = seq_lens
        self.block_tables = block_tables


def trtllm_batch_decode_with_kv_cache(query, kv_cache, block_tables, seq_lens, max_seq_len, scale):
    """The trtllm-gen decode launcher and kernel: the host plans the KV split from ``max_seq_len``
    (``fmhaKernels.cuh``: CTAs per sequence from the maximum attention window, keys per CTA rounded to the KV
    step); CTA ``c`` of a sequence visits keys ``[c * seqLenPerCtaKv, (c + 1) * seqLenPerCtaKv)`` below its
    ``seq_lens``; a reduction merges the CTAs' partial softmaxes."""
    num_ctas = max(1, min(MAX_CTAS_KV, (max_seq_len + 2 * STEP_KV - 1) // (2 * STEP_KV)))
    seq_len_per_cta = math.ceil(math.ceil(max_seq_len / STEP_KV) / num_ctas) * STEP_KV
    span = num_ctas * seq_len_per_cta
    pos = torch.arange(span, device=query.device)
    blocks = block_tables[:, (pos // SEQ_SIZE_PER_BLOCK).clamp(max=block_tables.shape[1] - 1)].long()
    k = kv_cache[blocks, 0, pos % SEQ_SIZE_PER_BLOCK]                      # [bs, span, DIM]
    v = kv_cache[blocks, 1, pos % SEQ_SIZE_PER_BLOCK]
    scores = (k @ query[:, :, None]).squeeze(-1) * scale
    valid = pos[None, :] < seq_lens[:, None]
    parts = []
    for c in range(num_ctas):                                              # one CTA per KV chunk
        in_cta = valid & (pos[None, :] // seq_len_per_cta == c)
        m = scores.masked_fill(~in_cta, -1e30).amax(-1, keepdim=True)
        p = torch.where(in_cta, torch.exp(scores - m), torch.zeros_like(scores))
        parts.append((m, p.sum(-1, keepdim=True), (p[:, :, None] * v).sum(1)))
    m_all = torch.stack([m for m, _, _ in parts]).amax(0)                  # the multi-CTA reduction
    denom = sum(s * torch.exp(m - m_all) for m, s, _ in parts)
    acc = sum(o * torch.exp(m - m_all) for m, _, o in parts)
    return acc / denom


class FlashInferTRTLLMDecodeOp:
    def __init__(self, device):
        self.device = device
        self.scaling = DIM ** -0.5

    def prepare(self, attention_inputs: PyAttentionInputs) -> FlashInferTRTLLMParams:
        # need transfer to cuda, cuda graph can capture the add
        sequence_lengths = torch.ones(attention_inputs.sequence_lengths.shape[0], dtype=torch.int32,
                                      device=self.device)
        sequence_lengths.copy_(attention_inputs.sequence_lengths, non_blocking=True).add_(1)
        return FlashInferTRTLLMParams(
            batch_size=attention_inputs.sequence_lengths.size(0),
            max_seq_len=attention_inputs.sequence_lengths.max().item() + 1,
            seq_lens=sequence_lengths,
            block_tables=attention_inputs.kv_cache_block_id_device,
        )

    def forward(self, q, kv_cache, fmha_params: FlashInferTRTLLMParams):
        return trtllm_batch_decode_with_kv_cache(q, kv_cache, fmha_params.block_tables, fmha_params.seq_lens,
                                                 fmha_params.max_seq_len, self.scaling)


def write_kv_cache(k, v, kv_cache, block_tables, seq_lens):
    """The decode rope/KV-cache op: the new token's K and V go to position ``seq_lens - 1``."""
    pos = (seq_lens - 1).long()
    rows = torch.arange(k.shape[0], device=k.device)
    blocks = block_tables[rows, pos // SEQ_SIZE_PER_BLOCK].long()
    kv_cache[blocks, 0, pos % SEQ_SIZE_PER_BLOCK] = k
    kv_cache[blocks, 1, pos % SEQ_SIZE_PER_BLOCK] = v


class FlashInferTRTLLMDecodeImpl:
    def __init__(self, attn_inputs: PyAttentionInputs, device):
        self.fmha_impl = FlashInferTRTLLMDecodeOp(device)
        self.attn_inputs = attn_inputs
        self.fmha_params = self.fmha_impl.prepare(attn_inputs)

    def forward(self, q, k, v, kv_cache):
        p = self.fmha_params
        write_kv_cache(k, v, kv_cache, p.block_tables, p.seq_lens)
        return self.fmha_impl.forward(q, kv_cache, p)

    def prepare_cuda_graph(self, attn_inputs: PyAttentionInputs):
        new_fmha_params = self.fmha_impl.prepare(attn_inputs)
        self.fmha_params.seq_lens.copy_(new_fmha_params.seq_lens, non_blocking=True)


class GptModel:
    def __init__(self, device):
        gen = generator(3089625)
        self.device = device
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))

    def prepare_fmha_impl(self, inputs: PyModelInputs) -> FlashInferTRTLLMDecodeImpl:
        return FlashInferTRTLLMDecodeImpl(inputs.attention_inputs, self.device)

    def forward(self, inputs: PyModelInputs, kv_cache, attn: FlashInferTRTLLMDecodeImpl):
        h = self.emb[inputs.input_ids.long()]
        o = attn.forward(h @ self.wq, h @ self.wk, h @ self.wv, kv_cache)
        return h + o @ self.wo


class CudaGraphRunner:
    def __init__(self, model: GptModel, kv_cache, device, variant):
        self.model, self.kv_cache, self.device, self.variant = model, kv_cache, device, variant
        self.max_bs_, self.max_seq_len_, self.num_tokens_per_bs_ = MAX_BS, MAX_SEQ_LEN, 1
        self.initCapture()

    def initCaptureAttentionInputs(self, inputs: PyModelInputs, max_bs, num_tokens_per_bs):
        a = inputs.attention_inputs
        a.input_lengths = host(torch.full((max_bs,), num_tokens_per_bs, dtype=torch.int32), self.device)
        # sequence_lengths [batch_size, int32] (decode only); should be in pinned memory
        sequence_lengths = torch.ones(max_bs, dtype=torch.int32)
        if self.variant == "fix":
            sequence_lengths.fill_(self.max_seq_len_ - num_tokens_per_bs - 1)
        a.sequence_lengths = host(sequence_lengths, self.device)
        a.kv_cache_block_id_device = torch.zeros(max_bs, MAX_BLOCKS, dtype=torch.int32, device=self.device)

    def initCapture(self):
        inputs = PyModelInputs()
        inputs.input_ids = torch.zeros(self.max_bs_, dtype=torch.int32, device=self.device)
        self.initCaptureAttentionInputs(inputs, self.max_bs_, self.num_tokens_per_bs_)
        self.inputs = inputs
        self.attn_pyobj = self.model.prepare_fmha_impl(inputs)          # py_attn_pyobj_method_(inputs, true)
        self.captureOneGraphInstance()

    def captureOneGraphInstance(self):
        inputs, attn_pyobj = self.inputs, self.attn_pyobj
        attn_pyobj.prepare_cuda_graph(inputs.attention_inputs)
        a = inputs.attention_inputs
        self.graph, self.hidden_states = capture(                       # WarmUp twice, then capture
            lambda: self.model.forward(inputs, self.kv_cache, attn_pyobj), device=self.device, warmups=2,
            owner="CudaGraphRunner (decode)",
            static={"input_ids": inputs.input_ids, "seq_lens": attn_pyobj.fmha_params.seq_lens,
                    "kv_cache_block_id_device": a.kv_cache_block_id_device},
            state={"kv_cache": self.kv_cache})

    def prepareInputs(self, inputs: PyModelInputs):
        bs = inputs.input_ids.shape[0]
        cap = self.inputs
        cap.input_ids[:bs].copy_(inputs.input_ids)
        cap.attention_inputs.sequence_lengths[:bs].copy_(inputs.attention_inputs.sequence_lengths)
        cap.attention_inputs.kv_cache_block_id_device[:bs].copy_(inputs.attention_inputs.kv_cache_block_id_device)
        self.attn_pyobj.prepare_cuda_graph(cap.attention_inputs)

    def forward(self, inputs: PyModelInputs):
        self.prepareInputs(inputs)
        return replay(self.graph, self.hidden_states)


def run(variant: str, device: str = "cpu"):
    gen = generator(3089)
    kv_init = randn(NUM_BLOCKS, 2, SEQ_SIZE_PER_BLOCK, DIM, gen=gen, device=device)   # prefilled prefixes
    tables = [list(range(1 + r * MAX_BLOCKS, 1 + (r + 1) * MAX_BLOCKS)) for r in range(MAX_BS)]
    start_lens = [9, 14]
    tokens = torch.randint(0, VOCAB, (5, MAX_BS), generator=gen)

    def step_inputs(step):
        inputs = PyModelInputs()
        inputs.input_ids = tokens[step].to(torch.int32).to(device)
        a = inputs.attention_inputs
        a.sequence_lengths = host(torch.tensor([n + step for n in start_lens], dtype=torch.int32), device)
        a.kv_cache_block_id_device = torch.tensor(tables, dtype=torch.int32).to(device)
        return inputs

    def serve(graphed: bool):
        model = GptModel(device)
        kv_cache = kv_init.clone()
        runner = CudaGraphRunner(model, kv_cache, device, variant) if graphed else None
        outs = []
        for step in range(tokens.shape[0]):
            inputs = step_inputs(step)
            if graphed:
                outs.append(runner.forward(inputs).clone())
            else:
                attn = model.prepare_fmha_impl(inputs)               # eager: planned from this step's lengths
                outs.append(model.forward(inputs, kv_cache, attn).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
