"""Flash-decoding's KV-split grid is sized by the capture batch's dummy lengths (1): replays attend one block.

Upstream: https://github.com/hpcaitech/ColossalAI/commit/1821a6dab0ad6ad24ae25216e56268c4b0c0d365
("[fix] pytest and fix dyn grid bug", part of PR #5434 "[feat] cuda graph support and refactor
non-functional api").
Symptom: with ``use_cuda_graph=True`` the no-padding Llama inference engine decoded wrong tokens once the
sequences grew past one KV-cache block; the test comparing the CUDA-graph engine with the eager one
failed (ColossalAI ``feature/colossal-infer``, March 2024).
Mechanism: ``flash_decoding_attention`` sizes its launch on the host from ``max_seq_len_in_batch`` (the
``kv_seq_len`` int of ``InputMetaData``): grid axis 2 is ``cdiv(next_power_of_2(max_seq_len_in_batch),
BLOCK_KV)``, one program per KV block. ``capture_model`` builds the capture batch with
``sequence_lengths = ones(...)`` and ``kv_seq_len = sequence_lengths.max().item()`` = 1, so the captured
kernel has one KV split. Replays refresh ``sequence_lengths`` and ``block_tables`` in the static buffers,
and the reduce kernel, which reads each sequence's split count from the device ``kv_seq_len``, merges
every split of the sequence; but the replayed grid computed only the first: the other splits' partial
outputs and log-sum-exps are whatever the shared ``fd_inter_tensor`` (``mid_output``) last held.
Doctor: host-work-frozen, at ``flash_decoding_attention`` (the grid from the host ``max_seq_len_in_batch``).
Fix (upstream): capture with the longest possible first sequence, ``sequence_lengths[0] =
max_context_len_to_capture - 1`` and a full block-table row for it (``graph_block_tables[0, :] =
arange(0, max_num_blocks)``, other rows' first block past those), "to insure cuda graph could capture
the fixed cuda kernel grid in flash decoding"; blocks past a sequence's length return early on device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/hpcaitech/ColossalAI/commit/1821a6dab0ad6ad24ae25216e56268c4b0c0d365"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "flash_decoding_attention"
SYMPTOM = "graph decoding attends over the first KV block only; later splits merge stale mid_output"
VOCAB, HEADS, HEAD_DIM, BLOCK_SIZE = 10, 1, 4, 2
MAX_INPUT_LEN, MAX_OUTPUT_LEN = 4, 4
MAX_BATCH_SIZE = 2
NUM_BLOCKS = 12
_BATCH_SIZES_TO_CAPTURE = [1, 2]


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class InferenceConfig:
    max_batch_size: int = MAX_BATCH_SIZE
    max_input_len: int = MAX_INPUT_LEN
    max_output_len: int = MAX_OUTPUT_LEN
    block_size: int = BLOCK_SIZE
    use_cuda_graph: bool = False

    def __post_init__(self):
        self.max_context_len_to_capture = self.max_input_len + self.max_output_len


class FDIntermTensors:
    """The engine-wide flash-decoding intermediates, allocated once and shared by every step."""

    def __init__(self, max_batch_size, max_context_len, device):
        kv_max_split_num = (max_context_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        self.mid_output = torch.zeros(max_batch_size, HEADS, kv_max_split_num, HEAD_DIM, device=device)
        self.mid_output_lse = torch.zeros(max_batch_size, HEADS, kv_max_split_num, device=device)


@dataclass
class InputMetaData:
    block_tables: torch.Tensor
    sequence_lengths: torch.Tensor
    fd_inter_tensor: FDIntermTensors
    batch_size: int
    is_prompts: bool = False
    use_cuda_graph: bool = False
    kv_seq_len: int = 512                 # the batch's longest sequence: a host int
    head_dim: int = HEAD_DIM


def copy_kv_to_blocked_cache(k, k_cache, kv_lengths, block_tables):
    """Write each sequence's new token at position ``kv_lengths - 1`` of its blocks."""
    pos = kv_lengths - 1
    blocks = block_tables.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1)
    k_cache[blocks, :, pos % BLOCK_SIZE] = k


def flash_decoding_attention(q, k_cache, v_cache, kv_seq_len, block_tables, block_size,
                             max_seq_len_in_batch=None, output=None, mid_output=None, mid_output_lse=None):
    """Split-KV decoding: ``_flash_decoding_fwd_kernel`` over grid (bsz, heads, kv splits), then
    ``_flash_decoding_fwd_reduce_kernel`` merging each sequence's ``cdiv(kv_seq_len, BLOCK_KV)`` splits."""
    bsz = q.shape[0]
    BLOCK_KV = block_size
    sm_scale = 1.0 / HEAD_DIM ** 0.5
    max_seq_len_in_batch = kv_seq_len.max().item() if max_seq_len_in_batch is None else max_seq_len_in_batch
    grid_kv = math.ceil(next_power_of_2(max_seq_len_in_batch) / BLOCK_KV)
    # _flash_decoding_fwd_kernel: one program per (sequence, head, KV block)
    for split in range(grid_kv):
        blocks = block_tables[:, split]
        pos = split * BLOCK_KV + torch.arange(BLOCK_KV, device=q.device)
        valid = pos[None, :] < kv_seq_len[:, None]
        k, v = k_cache[blocks], v_cache[blocks]                       # [bsz, heads, BLOCK, D]
        s = (q[:, :, None, :] * k).sum(-1) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(s, -1)
        acc = (torch.softmax(s, -1)[..., None] * v).sum(-2)
        live = (split * BLOCK_KV < kv_seq_len)                        # blocks past the sequence return early
        mid_output[:bsz, :, split] = torch.where(live[:, None, None], acc, mid_output[:bsz, :, split])
        mid_output_lse[:bsz, :, split] = torch.where(live[:, None], lse, mid_output_lse[:bsz, :, split])
    # _flash_decoding_fwd_reduce_kernel: the split count comes from the device kv_seq_len
    c = torch.arange(mid_output.shape[2], device=q.device)
    mine = c[None, :] < ((kv_seq_len + BLOCK_KV - 1) // BLOCK_KV)[:, None]
    w = torch.softmax(mid_output_lse[:bsz].masked_fill(~mine[:, None, :], float("-inf")), -1)
    output[:bsz] = (w[..., None] * mid_output[:bsz]).sum(-2).reshape(bsz, HEADS * HEAD_DIM)
    return output[:bsz]


class NopadLlamaForCausalLM:
    def __init__(self, device):
        gen = generator(5434)
        self.embed_tokens = randn(VOCAB, HEADS * HEAD_DIM, gen=gen, device=device)
        self.q_proj, self.k_proj, self.v_proj = (randn(HEADS * HEAD_DIM, HEADS * HEAD_DIM, gen=gen,
                                                       device=device, scale=0.7) for _ in range(3))
        self.lm_head = randn(HEADS * HEAD_DIM, VOCAB, gen=gen, device=device)

    def __call__(self, input_tokens_ids, output_tensor, inputmetadata, k_caches, v_caches):
        h = self.embed_tokens[input_tokens_ids]
        q = (h @ self.q_proj).view(-1, HEADS, HEAD_DIM)
        copy_kv_to_blocked_cache((h @ self.k_proj).view(-1, HEADS, HEAD_DIM), k_caches,
                                 inputmetadata.sequence_lengths, inputmetadata.block_tables)
        copy_kv_to_blocked_cache((h @ self.v_proj).view(-1, HEADS, HEAD_DIM), v_caches,
                                 inputmetadata.sequence_lengths, inputmetadata.block_tables)
        fd = inputmetadata.fd_inter_tensor
        attn = flash_decoding_attention(q, k_caches, v_caches, inputmetadata.sequence_lengths,
                                        inputmetadata.block_tables, BLOCK_SIZE, inputmetadata.kv_seq_len,
                                        output_tensor, fd.mid_output, fd.mid_output_lse)
        return (h + attn) @ self.lm_head


class CUDAGraphRunner:
    def __init__(self, model):
        self.model = model
        self.graph = None

    def capture(self, input_tokens_ids, output_tensor, inputmetadata, k_caches, v_caches, memory_pool, device):
        self.input_buffers = {"input_tokens_ids": input_tokens_ids, "output_tensor": output_tensor,
                              "block_tables": inputmetadata.block_tables,
                              "sequence_lengths": inputmetadata.sequence_lengths}
        # run kernel once to cache the kernel, avoid stream capture error (the kit's warmup)
        self.graph, hidden_states = capture(
            lambda: self.model(input_tokens_ids, output_tensor, inputmetadata, k_caches, v_caches),
            device=device, pool=memory_pool, name=f"batch size {inputmetadata.batch_size}",
            static=self.input_buffers, owner="colossalai InferenceEngine (CUDAGraphRunner)")
        self.output_buffers = {"logits": hidden_states}

    def forward(self, input_tokens_ids, output_tensor, inputmetadata, k_caches, v_caches):
        self.input_buffers["input_tokens_ids"].copy_(input_tokens_ids)
        self.input_buffers["output_tensor"].copy_(output_tensor)
        # for flexible block_table
        self.input_buffers["block_tables"].fill_(-1)
        M, N = inputmetadata.block_tables.shape
        self.input_buffers["block_tables"][:M, :N].copy_(inputmetadata.block_tables)
        self.input_buffers["sequence_lengths"].copy_(inputmetadata.sequence_lengths)
        return replay(self.graph, self.output_buffers["logits"])

    __call__ = forward


class InferenceEngine:
    def __init__(self, model, inference_config, device, variant):
        self.model, self.inference_config, self.device, self.variant = model, inference_config, device, variant
        max_context = inference_config.max_context_len_to_capture
        self.k_cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, device=device)
        self.v_cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, device=device)
        self.fd_inter_tensor = FDIntermTensors(inference_config.max_batch_size, max_context, device)
        self.graph_runners = {}
        if inference_config.use_cuda_graph:
            self.graph_memory_pool = graph_pool_handle(device)
            self.capture_model(self.k_cache, self.v_cache)

    def capture_model(self, k_cache, v_cache):
        block_size = self.inference_config.block_size
        max_batch_size = max(_BATCH_SIZES_TO_CAPTURE)
        max_context_len_to_capture = self.inference_config.max_context_len_to_capture
        max_num_blocks = (max_context_len_to_capture + block_size - 1) // block_size
        input_tokens_ids = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        graph_block_tables = torch.zeros(max_batch_size, max_num_blocks, dtype=torch.long)
        if self.variant == "fix":
            graph_block_tables[:, 0] = torch.arange(max_num_blocks, max_num_blocks + max_batch_size)
            # NOTE this is a hack to insure cuda graph could capture the fixed cuda kernel grid in flash
            # decoding, to make the first seqlen as the max_seq_len
            graph_block_tables[0, :] = torch.arange(0, max_num_blocks)
        block_tables = graph_block_tables.to(self.device)
        output_tensor = torch.zeros(max_batch_size, HEADS * HEAD_DIM, device=self.device)
        batch_size_capture_list = [bs for bs in _BATCH_SIZES_TO_CAPTURE if bs <= self.inference_config.max_batch_size]
        sequence_lengths = torch.ones(max_batch_size, dtype=torch.long, device=self.device)
        if self.variant == "fix":
            sequence_lengths[0] = max_context_len_to_capture - 1
        for batch_size in reversed(batch_size_capture_list):
            input_meta_data = InputMetaData(block_tables=block_tables[:batch_size],
                                            sequence_lengths=sequence_lengths[:batch_size],
                                            fd_inter_tensor=self.fd_inter_tensor, batch_size=batch_size,
                                            use_cuda_graph=True,
                                            kv_seq_len=sequence_lengths[:batch_size].max().item())
            graph_runner = CUDAGraphRunner(self.model)
            graph_runner.capture(input_tokens_ids[:batch_size], output_tensor[:batch_size], input_meta_data,
                                 k_cache, v_cache, self.graph_memory_pool, self.device)
            self.graph_runners[batch_size] = graph_runner

    def step(self, input_ids, block_tables, sequence_lengths):
        bsz = len(input_ids)
        input_meta_data = InputMetaData(block_tables=block_tables, sequence_lengths=sequence_lengths,
                                        fd_inter_tensor=self.fd_inter_tensor, batch_size=bsz,
                                        use_cuda_graph=self.inference_config.use_cuda_graph and bsz in self.graph_runners,
                                        kv_seq_len=int(sequence_lengths.max().item()))
        output_tensor = torch.zeros(bsz, HEADS * HEAD_DIM, device=self.device)
        model_executable = self.graph_runners[bsz] if input_meta_data.use_cuda_graph else self.model
        logits = model_executable(input_ids, output_tensor, input_meta_data, self.k_cache, self.v_cache)
        return logits.clone()


def run(variant: str, device: str = "cpu"):
    model = NopadLlamaForCausalLM(device)
    gen = generator(1821)
    prompt_lens = [3, 2]
    seq_blocks = [[6, 7, 8, 9], [10, 11, 3, 2]]           # the request handler's block tables
    prefix_k = randn(2, MAX_INPUT_LEN, HEADS, HEAD_DIM, gen=gen, device=device)
    prefix_v = randn(2, MAX_INPUT_LEN, HEADS, HEAD_DIM, gen=gen, device=device)
    tokens = torch.randint(0, VOCAB, (MAX_OUTPUT_LEN, 2), generator=gen)

    def serve(use_cuda_graph: bool):
        config = InferenceConfig(use_cuda_graph=use_cuda_graph)
        engine = InferenceEngine(model, config, device, variant)
        for i, n in enumerate(prompt_lens):                   # prefill (eager): the prompts' KV
            for p in range(n):
                b = seq_blocks[i][p // BLOCK_SIZE]
                engine.k_cache[b, :, p % BLOCK_SIZE] = prefix_k[i, p]
                engine.v_cache[b, :, p % BLOCK_SIZE] = prefix_v[i, p]
        block_tables = torch.tensor(seq_blocks, device=device)
        outs = []
        for t in range(MAX_OUTPUT_LEN):                       # decode: lengths 4..7 and 3..6
            lengths = torch.tensor([n + 1 + t for n in prompt_lens], device=device)
            outs.append(engine.step(tokens[t].to(device), block_tables, lengths))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
