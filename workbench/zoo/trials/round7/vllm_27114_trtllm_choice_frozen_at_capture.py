"""The FULL decode graph keeps the attention kernel chosen at capture; at runtime the builder picks the other.

Upstream: https://github.com/vllm-project/vllm/pull/27114 ("[Bugfix] Use PIECEWISE cudagraphs on Blackwell if
max_model_len > 131072"), fixing https://github.com/vllm-project/vllm/issues/27057 (also reported as
flashinfer-ai/flashinfer#1968, "TRTLLM attention + full cudagraph produces incorrect output at long context
length (>128k) on Blackwell").
Symptom: on B200 with the default FULL_AND_PIECEWISE mode, any model whose max_model_len exceeds 128K
(Qwen3-VL, Llama-3-8B-Instruct-Gradient-1048k) loses all accuracy (GSM8K 86% -> 1%); PIECEWISE, Hopper,
FlashAttention or VLLM_USE_TRTLLM_ATTENTION=0 are fine (vLLM V1, Oct 2025).
Mechanism: the FlashInfer backend chooses TRTLLM-gen or native FlashInfer decode per step from
``(num_tokens, max_seq_len, kv_cache_dtype)``, TRTLLM only up to ``max_seq_len`` 131072, and the FULL decode
graph is captured from a dummy batch whose ``max_seq_len`` is ``max_model_len`` (> 128K), so the graph keeps
``FlashInferImpl.forward``'s native branch (``decode_wrapper.run``). At runtime the sequences are short and
``build`` selects TRTLLM, which skips ``fast_plan_decode``. The replayed graph still runs the native kernel
on the wrapper's plan buffers (``paged_kv_last_page_len``, the padded ``indptr`` tail), which still describe
the capture's dummy batch, and attends over the wrong keys.
Doctor: warmup-divergence, at ``forward`` (``FlashInferImpl.forward``: the branch on ``decode_use_trtllm``
taken once at capture; eager steps take the TRTLLM branch the graph never recorded).
Fix (upstream): in ``VllmConfig`` force ``cudagraph_mode=PIECEWISE`` on Blackwell when
``max_model_len > 131072``, so attention runs outside the graphs and the kernel choice is made every step
(later, vllm#28755 lifted the 131072 limit from ``use_trtllm_attention`` altogether).
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/27114"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = "FULL decode graph replays the native FlashInfer kernel on a stale plan: garbage tokens above 128K max_model_len"

VOCAB, DIM, PAGE = 16, 4, 2                    # PAGE: kv-cache block size (tokens per page)
MAX_PAGES_PER_REQ = 4                          # block-table width
MAX_CTX = PAGE * MAX_PAGES_PER_REQ
NUM_BLOCKS = 1 + 3 * MAX_PAGES_PER_REQ         # block 0 is vLLM's null block, never given to a request
CAPTURE_SIZES = [2, 4]
MAX_BS = max(CAPTURE_SIZES)
MAX_MODEL_LEN = 262144                         # Qwen3-VL's default context: above the TRTLLM limit
TRTLLM_MAX_SEQ_LEN = 131072
PAD_SLOT_ID = -1


# ---------------------------------------------------------------- flashinfer / vllm.utils.flashinfer
def supports_trtllm_attention() -> bool:
    return True                                # the machine is a Blackwell (SM100)


def use_trtllm_attention(num_tokens: int, max_seq_len: int, kv_cache_dtype: str) -> bool:
    """Auto-selection of the TRTLLM-gen kernels: small batches, max_seq_len within the kernel's limit."""
    if not supports_trtllm_attention():
        return False
    return num_tokens <= 256 and max_seq_len <= TRTLLM_MAX_SEQ_LEN and kv_cache_dtype == "auto"


def _attend(query, key_cache, value_cache, slots, valid):
    scores = (query[:, None, :] * key_cache[slots]).sum(-1) / DIM ** 0.5
    probs = torch.nan_to_num(torch.softmax(scores.masked_fill(~valid, float("-inf")), -1))
    return (probs[..., None] * value_cache[slots]).sum(1)


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's decode wrapper in CUDA-graph mode: the kernel reads the paged-KV layout from buffers
    fixed at construction (views of the metadata builder's persistent buffers), which ``plan`` refreshes."""

    def __init__(self, batch_size, paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
        self._fixed_batch_size = batch_size
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    def plan(self, indptr_cpu, last_page_len_cpu):
        self._paged_kv_indptr_buf.copy_(indptr_cpu)                 # host-to-device copies of the plan
        self._paged_kv_last_page_len_buf.copy_(last_page_len_cpu)

    def run(self, query, kv_cache, out):
        key_cache, value_cache = kv_cache
        indptr, indices = self._paged_kv_indptr_buf, self._paged_kv_indices_buf
        num_pages = indptr[1:] - indptr[:-1]
        kv_len = (num_pages - 1).clamp_min(0) * PAGE + self._paged_kv_last_page_len_buf
        pos = torch.arange(MAX_CTX, device=query.device)
        page = indices[(indptr[:-1, None] + pos // PAGE).clamp(max=indices.shape[0] - 1)]
        out.copy_(_attend(query, key_cache, value_cache, page * PAGE + pos % PAGE, pos[None, :] < kv_len[:, None]))


def fast_plan_decode(wrapper, indptr_cpu, last_page_len_cpu):
    wrapper.plan(indptr_cpu, last_page_len_cpu)


def trtllm_batch_decode_with_kv_cache(query, kv_cache, block_tables, seq_lens, max_seq_len, out):
    """TRTLLM-gen decode: reads the block table and the sequence lengths directly, no plan."""
    key_cache, value_cache = kv_cache
    pos = torch.arange(MAX_CTX, device=query.device)
    slots = block_tables[:, pos // PAGE] * PAGE + pos % PAGE
    out.copy_(_attend(query, key_cache, value_cache, slots, pos[None, :] < seq_lens[:, None]))


# ---------------------------------------------------------------- vllm/v1/attention/backends/flashinfer.py
class CommonAttentionMetadata:
    def __init__(self, num_reqs, seq_lens, seq_lens_cpu, block_table_tensor, slot_mapping, max_seq_len):
        self.num_reqs = num_reqs
        self.seq_lens = seq_lens                        # device views of the runner's persistent buffers
        self.seq_lens_cpu = seq_lens_cpu
        self.block_table_tensor = block_table_tensor
        self.slot_mapping = slot_mapping
        self.max_seq_len = max_seq_len                  # a Python int


class FlashInferMetadata:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FlashInferMetadataBuilder:
    def __init__(self, device, enable_cuda_graph: bool):
        self.enable_cuda_graph = enable_cuda_graph      # cudagraph_mode.decode_mode() == FULL
        self.cache_dtype = "auto"
        self.paged_kv_indptr = torch.zeros(MAX_BS + 1, dtype=torch.int64, device=device)
        self.paged_kv_indices = torch.zeros(MAX_BS * MAX_PAGES_PER_REQ, dtype=torch.int64, device=device)
        self.paged_kv_last_page_len = torch.zeros(MAX_BS, dtype=torch.int64, device=device)
        self.paged_kv_indptr_cpu = torch.zeros(MAX_BS + 1, dtype=torch.int64)
        self.paged_kv_last_page_len_cpu = torch.zeros(MAX_BS, dtype=torch.int64)
        self._decode_wrappers_cudagraph: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}

    def _get_decode_wrapper(self, batch_size: int, use_cudagraph: bool):
        if use_cudagraph and batch_size in self._decode_wrappers_cudagraph:
            return self._decode_wrappers_cudagraph[batch_size]
        wrapper = BatchDecodeWithPagedKVCacheWrapper(batch_size, self.paged_kv_indptr[:batch_size + 1],
                                                     self.paged_kv_indices, self.paged_kv_last_page_len[:batch_size])
        if use_cudagraph:
            self._decode_wrappers_cudagraph[batch_size] = wrapper
        return wrapper

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        n = common.num_reqs
        seq_lens_cpu = common.seq_lens_cpu[:n]
        num_pages = (seq_lens_cpu + PAGE - 1) // PAGE
        self.paged_kv_indptr_cpu[0] = 0
        self.paged_kv_indptr_cpu[1:n + 1] = torch.cumsum(num_pages, 0)
        self.paged_kv_indptr[:n + 1].copy_(self.paged_kv_indptr_cpu[:n + 1])     # always refreshed
        for i in range(n):                                                        # _copy_page_indices_kernel
            start = int(self.paged_kv_indptr_cpu[i])
            self.paged_kv_indices[start:start + int(num_pages[i])].copy_(
                common.block_table_tensor[i, :int(num_pages[i])])
        last = seq_lens_cpu % PAGE
        self.paged_kv_last_page_len_cpu[:n] = torch.where(last == 0, torch.full_like(last, PAGE), last)

        decode_use_trtllm = use_trtllm_attention(n, common.max_seq_len, self.cache_dtype)
        md = FlashInferMetadata(num_decodes=n, decode_use_trtllm=decode_use_trtllm, max_seq_len=common.max_seq_len,
                                seq_lens=common.seq_lens, block_table_tensor=common.block_table_tensor,
                                slot_mapping=common.slot_mapping)
        use_cudagraph = self.enable_cuda_graph and n <= MAX_BS
        if use_cudagraph:
            num_input_tokens = next(s for s in CAPTURE_SIZES if s >= n)          # pad_for_cudagraph
            self.paged_kv_indptr_cpu[1 + n:1 + num_input_tokens] = self.paged_kv_indptr_cpu[n]
            self.paged_kv_last_page_len_cpu[n:num_input_tokens] = 1
        else:
            num_input_tokens = n
        md.decode_wrapper = self._get_decode_wrapper(num_input_tokens, use_cudagraph)
        if not md.decode_use_trtllm:
            fast_plan_decode(md.decode_wrapper, self.paged_kv_indptr_cpu[:num_input_tokens + 1],
                             self.paged_kv_last_page_len_cpu[:num_input_tokens])
        return md


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    slots = slot_mapping.clamp_min(0)          # PAD_SLOT_ID rows are skipped by the kernel (here: null block)
    key_cache[slots] = key
    value_cache[slots] = value


class FlashInferImpl:
    def forward(self, query, key, value, kv_cache, attn_metadata, output):
        if attn_metadata is None:              # profiling run / piecewise capture
            return output
        num_tokens = query.shape[0]
        reshape_and_cache_flash(key, value, kv_cache[0], kv_cache[1], attn_metadata.slot_mapping[:num_tokens])
        if not attn_metadata.decode_use_trtllm:
            attn_metadata.decode_wrapper.run(query, kv_cache, out=output)
        else:
            trtllm_batch_decode_with_kv_cache(query, kv_cache, attn_metadata.block_table_tensor[:num_tokens],
                                              attn_metadata.seq_lens[:num_tokens], attn_metadata.max_seq_len,
                                              out=output)
        return output


class ForwardContext:
    attn_metadata: FlashInferMetadata | None = None


_forward_context = ForwardContext()


# ---------------------------------------------------------------- vllm/config + the model runner
def resolve_cudagraph_mode(requested: CUDAGraphMode, max_model_len: int, fixed: bool) -> CUDAGraphMode:
    """VllmConfig: the fix falls back to PIECEWISE (attention outside the graphs) on Blackwell when the
    context is longer than the TRTLLM kernels support, since the kernel choice is dynamic."""
    if (fixed and requested is CUDAGraphMode.FULL and supports_trtllm_attention()
            and max_model_len > TRTLLM_MAX_SEQ_LEN):
        return CUDAGraphMode.PIECEWISE
    return requested


class GPUModelRunner:
    def __init__(self, device, mode: CUDAGraphMode):
        gen = generator(27114)
        self.device = device
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_emb = randn(MAX_CTX, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.7) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.kv_cache = (torch.zeros(NUM_BLOCKS * PAGE, DIM, device=device),
                         torch.zeros(NUM_BLOCKS * PAGE, DIM, device=device))
        # persistent input buffers (InputBatch / CommonAttentionMetadata sources)
        self.input_ids = torch.zeros(MAX_BS, dtype=torch.int64, device=device)
        self.positions = torch.zeros(MAX_BS, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(MAX_BS, dtype=torch.int64, device=device)
        self.seq_lens_cpu = torch.zeros(MAX_BS, dtype=torch.int64)
        self.block_table = torch.zeros(MAX_BS, MAX_PAGES_PER_REQ, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((MAX_BS,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.mode = mode
        self.attn_metadata_builder = FlashInferMetadataBuilder(device, enable_cuda_graph=mode is CUDAGraphMode.FULL)
        self.impl = FlashInferImpl()
        self.manager = GraphManager(self.forward, CAPTURE_SIZES, device=device, mode=mode,
                                    static_buffers=self._dummy_run, name="GPUModelRunner")
        self.unified_attention = self.manager.eager(self._unified_attention)      # vllm::unified_attention

    def _buffers(self):
        b = self.attn_metadata_builder
        return {"input_ids": self.input_ids, "positions": self.positions, "seq_lens": self.seq_lens,
                "block_table": self.block_table, "slot_mapping": self.slot_mapping,
                "paged_kv_indptr": b.paged_kv_indptr, "paged_kv_indices": b.paged_kv_indices,
                "paged_kv_last_page_len": b.paged_kv_last_page_len}

    def _dummy_run(self, num_tokens: int):
        """Prepares the dummy batch a capture of ``num_tokens`` runs on: FULL graphs get attention metadata
        built for it, with ``max_seq_len = max_model_len``; PIECEWISE captures run without (attention is
        outside the pieces)."""
        self.input_ids[:num_tokens] = 0
        self.positions[:num_tokens] = 0
        self.seq_lens[:num_tokens] = 1
        self.seq_lens_cpu[:num_tokens] = 1
        self.block_table[:num_tokens] = 0
        self.slot_mapping[:num_tokens] = PAD_SLOT_ID
        _forward_context.attn_metadata = None
        if self.mode is CUDAGraphMode.FULL:
            _forward_context.attn_metadata = self.attn_metadata_builder.build(CommonAttentionMetadata(
                num_tokens, self.seq_lens, self.seq_lens_cpu, self.block_table, self.slot_mapping, MAX_MODEL_LEN))
        return self._buffers()

    def _unified_attention(self, query, key, value):
        output = torch.zeros_like(query)
        return self.impl.forward(query, key, value, self.kv_cache, _forward_context.attn_metadata, output)

    def forward(self, num_tokens: int):
        h = self.emb[self.input_ids[:num_tokens]] + self.pos_emb[self.positions[:num_tokens]]
        attn = self.unified_attention(h @ self.wq, h @ self.wk, h @ self.wv)
        return (h + attn @ self.wo) @ self.lm_head

    def capture_model(self):
        events.persistent_state("GPUModelRunner", {"key_cache": self.kv_cache[0], "value_cache": self.kv_cache[1]})
        self.manager.capture()
        _forward_context.attn_metadata = None

    def prefill(self, prompt, blocks):
        """Eager prefill: the prompt's keys/values into the request's blocks."""
        pos = torch.arange(len(prompt), device=self.device)
        h = self.emb[torch.tensor(prompt, device=self.device)] + self.pos_emb[pos]
        slots = torch.tensor(blocks, device=self.device)[pos // PAGE] * PAGE + pos % PAGE
        self.kv_cache[0][slots] = h @ self.wk
        self.kv_cache[1][slots] = h @ self.wv

    def execute_model(self, token_ids, positions, block_tables):
        n = len(token_ids)
        size = self.manager.dispatch(n)
        rows = n if size is None else size
        self.input_ids[:n] = torch.tensor(token_ids, device=self.device)
        self.positions[:n] = torch.tensor(positions, device=self.device)
        self.seq_lens[:n] = self.positions[:n] + 1
        self.seq_lens_cpu[:n] = torch.tensor(positions) + 1
        self.block_table[:n] = torch.tensor(block_tables, device=self.device)
        pos = self.positions[:n]
        self.slot_mapping[:n] = self.block_table[torch.arange(n, device=self.device), pos // PAGE] * PAGE + pos % PAGE
        # padded rows: token 0, null block, no cache write
        self.input_ids[n:rows] = 0
        self.positions[n:rows] = 0
        self.seq_lens[n:rows] = 0
        self.seq_lens_cpu[n:rows] = 0
        self.block_table[n:rows] = 0
        self.slot_mapping[n:rows] = PAD_SLOT_ID
        common = CommonAttentionMetadata(n, self.seq_lens, self.seq_lens_cpu, self.block_table, self.slot_mapping,
                                         int(self.seq_lens_cpu[:n].max()))
        _forward_context.attn_metadata = self.attn_metadata_builder.build(common)
        try:
            if size is None:
                return self.manager.run_eager(n)[:n].clone()
            return self.manager.replay(size, n).clone()
        finally:
            _forward_context.attn_metadata = None


def requests():
    """Prompts and blocks of three requests (block 0 is the null block)."""
    return [([3, 7, 1], [1, 2, 3, 4]), ([5, 2, 9, 4], [5, 6, 7, 8]), ([8, 6], [9, 10, 11, 12])]


def schedule():
    """Decode steps: all three requests (3 rows, padded to 4), then the first two (2 rows)."""
    reqs = requests()
    steps, lengths, tokens = [], [len(p) for p, _ in reqs], [11, 12, 13, 14, 15, 10]
    for step, active in enumerate(([0, 1, 2], [0, 1], [0, 1, 2])):
        ids = [tokens[(step + r) % len(tokens)] for r in active]
        positions = [lengths[r] for r in active]
        steps.append((ids, positions, [reqs[r][1] for r in active]))
        for r in active:
            lengths[r] += 1
    return steps


def run(variant: str, device: str = "cpu"):
    fixed = variant == "fix"

    def serve(enforce_eager: bool):
        requested = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL   # FULL_AND_PIECEWISE's decode mode
        runner = GPUModelRunner(device, resolve_cudagraph_mode(requested, MAX_MODEL_LEN, fixed))
        runner.capture_model()
        for prompt, blocks in requests():
            runner.prefill(prompt, blocks)
        return [runner.execute_model(ids, pos, tables) for ids, pos, tables in schedule()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
