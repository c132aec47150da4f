"""Padded decode rows keep an earlier batch's linear-attention block ids and overwrite a new request's state.

Upstream: https://github.com/alibaba/rtp-llm/pull/829 ("fix: fix qwen3 next decode padding", commit
2768fc92).
Symptom: Qwen3-Next (hybrid full / GatedDeltaNet linear attention) decode under CUDA graphs corrupts the
SSM/conv states of other requests; eager decode is fine (rtp-llm, April 2026).
Mechanism: ``CudaGraphRunner::prepareInputs`` clears the legacy ``kv_cache_kernel_block_id_device`` every
step ("otherwise it will cause the cache block pollution") but copies the hybrid cache's per-group block
tables (``kv_cache_kernel_block_id_device_by_group``) over the real rows only, so padded rows keep the block
ids (and sequence lengths) of an earlier, larger batch. The model rebinds each layer's block map to its
group's table (``select_block_map_for_layer``), so the cleared legacy table is never read, and
``fused_recurrent_gated_delta_rule`` runs every padded row: it skips a row only when its block id is
``<= 0``, otherwise it loads the state of that block and stores the updated state back in place. A block
that a finished request gave back and a newly prefilled request now owns gets the padded row's update.
Doctor: stale-padding, at ``fused_recurrent_gated_delta_rule`` (the in-place state store through the padded
rows' block ids).
Fix (upstream): ``fill_(0)`` each per-group block table (device and host) before copying the real rows:
block 0 is the reserved null block, for which the kernel skips the row.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/alibaba/rtp-llm/pull/829"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "fused_recurrent_gated_delta_rule"
SYMPTOM = "a new request decodes from a linear-attention state that a padded row updated"

VOCAB, DIM = 12, 4
SEQ_SIZE_PER_BLOCK = 2          # tokens per cache block: a linear-attention state is stored per block
MAX_BLOCKS = 4                  # block-table width (max_seq_len / seq_size_per_block)
NUM_BLOCKS = 12                 # block 0 is the reserved null block
CAPTURE_SIZES = [2, 4]
KV_CACHE_LAYER_TO_GROUP = [1]   # the modelled layer is a linear-attention layer (group 1 of the hybrid cache)
KV_CACHE_GROUP_NUM = 2


def cal_block_idx(x, seq_size_per_block):
    return (x - 1) // seq_size_per_block


class PyAttentionInputs:
    """The attention metadata one forward reads (views of the runner's static buffers under graphs)."""

    def __init__(self, sequence_lengths_plus_1_d, kv_cache_kernel_block_id_device,
                 kv_cache_kernel_block_id_device_by_group, kv_cache_layer_to_group):
        self.sequence_lengths_plus_1_d = sequence_lengths_plus_1_d
        self.kv_cache_kernel_block_id_device = kv_cache_kernel_block_id_device
        self.kv_cache_kernel_block_id_device_by_group = kv_cache_kernel_block_id_device_by_group
        self.kv_cache_layer_to_group = kv_cache_layer_to_group


def select_block_map_for_layer(attention_inputs, layer_idx):
    """Hybrid attention: point the layer's block map at its group's table (model_desc/block_map.py)."""
    gid = attention_inputs.kv_cache_layer_to_group[layer_idx]
    attention_inputs.kv_cache_kernel_block_id_device = attention_inputs.kv_cache_kernel_block_id_device_by_group[gid]
    return gid


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, block_map, seq_size_per_block,
                                     sequence_lengths):
    """One decode token per row; the state is read from the block of the previous position and stored in
    place into the block of the current one (``inplace_final_state=True``). Rows whose read block id is
    ``<= 0`` return early: no state read, no state write, no output."""
    rows = torch.arange(q.shape[0], device=q.device)
    read_block_id = block_map[rows, cal_block_idx(sequence_lengths - 1, seq_size_per_block)]
    write_block_id = block_map[rows, cal_block_idx(sequence_lengths, seq_size_per_block)]
    valid = read_block_id > 0
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    h = initial_state[read_block_id] * torch.exp(g)[:, None, None]              # [rows, K, V]
    v = (v - (h * k[:, :, None]).sum(1)) * beta[:, None]
    h = h + k[:, :, None] * v[:, None, :]
    o = (h * q[:, :, None]).sum(1)
    initial_state[write_block_id] = torch.where(valid[:, None, None], h, initial_state[write_block_id])
    return torch.where(valid[:, None], o, torch.zeros_like(o))


class Qwen3NextModel:
    def __init__(self, device):
        gen = generator(829)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(3))
        self.wa, self.wb = randn(DIM, gen=gen, device=device), randn(DIM, gen=gen, device=device)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def gdn_inputs(self, input_ids):
        x = self.embed[input_ids]
        g = -torch.nn.functional.softplus(x @ self.wa)
        beta = torch.sigmoid(x @ self.wb)
        return x, x @ self.wq, x @ self.wk, x @ self.wv, g, beta

    def forward(self, input_ids, attention_inputs, ssm_states):
        h = self.embed[input_ids]
        for i, _ in enumerate(KV_CACHE_LAYER_TO_GROUP):
            # Switch to correct block_map for this layer in hybrid attention mode
            select_block_map_for_layer(attention_inputs, i)
            x, q, k, v, g, beta = self.gdn_inputs(input_ids)
            h = h + fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, initial_state=ssm_states,
                block_map=attention_inputs.kv_cache_kernel_block_id_device,
                seq_size_per_block=SEQ_SIZE_PER_BLOCK,
                sequence_lengths=attention_inputs.sequence_lengths_plus_1_d)
        return h @ self.lm_head

    def prefill(self, tokens, blocks, ssm_states):
        """Eager prefill: run the recurrence over the prompt and store the state after each block."""
        state = torch.zeros(DIM, DIM, device=ssm_states.device)
        for pos, tok in enumerate(tokens):
            _, q, k, v, g, beta = self.gdn_inputs(torch.tensor([tok], device=ssm_states.device))
            q, k, v = q[0], k[0] / torch.sqrt((k[0] * k[0]).sum() + 1e-6), v[0]
            state = state * torch.exp(g[0])
            state = state + k[:, None] * ((v - (state * k[:, None]).sum(0)) * beta[0])[None, :]
            if pos % SEQ_SIZE_PER_BLOCK == SEQ_SIZE_PER_BLOCK - 1 or pos == len(tokens) - 1:
                ssm_states[blocks[pos // SEQ_SIZE_PER_BLOCK]] = state


class BlockAllocator:
    def __init__(self):
        self.free = list(range(NUM_BLOCKS - 1, 0, -1))     # block 0 is never handed out

    def malloc(self):
        return self.free.pop()

    def release(self, blocks):
        self.free.extend(blocks)


class CudaGraphRunner:
    """Decode graphs per batch size over persistent attention inputs (rtp_llm/cpp/cuda/CudaGraph)."""

    def __init__(self, model, ssm_states, variant, device):
        self.model, self.ssm_states, self.variant, self.device = model, ssm_states, variant, device
        max_bs = CAPTURE_SIZES[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.sequence_lengths_plus_1_d = torch.full((max_bs,), SEQ_SIZE_PER_BLOCK, dtype=torch.int64, device=device)
        self.kv_cache_kernel_block_id_device = torch.zeros(max_bs, MAX_BLOCKS, dtype=torch.int64, device=device)
        self.kv_cache_kernel_block_id_device_by_group = [
            torch.zeros(max_bs, MAX_BLOCKS, dtype=torch.int64, device=device) for _ in range(KV_CACHE_GROUP_NUM)]
        self.static = {"input_ids": self.input_ids, "sequence_lengths_plus_1_d": self.sequence_lengths_plus_1_d,
                       "kv_cache_kernel_block_id_device": self.kv_cache_kernel_block_id_device,
                       **{f"kv_cache_kernel_block_id_device_by_group[{g}]": t
                          for g, t in enumerate(self.kv_cache_kernel_block_id_device_by_group)}}
        events.persistent_state("CudaGraphRunner", {"ssm_states": ssm_states})
        self.manager = GraphManager(self._forward, CAPTURE_SIZES, device=device, mode=CUDAGraphMode.FULL,
                                    num_warmups=1, static_buffers=self.static, name="CudaGraphRunner")
        self.manager.capture()

    def _forward(self, bs):
        attention_inputs = PyAttentionInputs(
            self.sequence_lengths_plus_1_d[:bs], self.kv_cache_kernel_block_id_device[:bs],
            [t[:bs] for t in self.kv_cache_kernel_block_id_device_by_group], KV_CACHE_LAYER_TO_GROUP)
        return self.model.forward(self.input_ids[:bs], attention_inputs, self.ssm_states)

    @staticmethod
    def copySmallerIntoLarger(source_tensor, target_tensor):
        target_tensor[:source_tensor.shape[0], :source_tensor.shape[1]].copy_(source_tensor)

    def prepareInputs(self, input_ids, sequence_lengths_plus_1, block_ids_by_group):
        n = input_ids.shape[0]
        # clear kv_cache_kernel_block_id_device, otherwise it will cause the cache block pollution
        self.kv_cache_kernel_block_id_device.fill_(0)
        self.input_ids[:n].copy_(input_ids)
        self.sequence_lengths_plus_1_d[:n].copy_(sequence_lengths_plus_1)
        self.copySmallerIntoLarger(block_ids_by_group[0], self.kv_cache_kernel_block_id_device)
        # Hybrid cache: update per-group block tables (including group 0).
        for g in range(KV_CACHE_GROUP_NUM):
            if self.variant == "fix":
                # Clear per-group block tables before copying real entries.
                self.kv_cache_kernel_block_id_device_by_group[g].fill_(0)
            self.copySmallerIntoLarger(block_ids_by_group[g], self.kv_cache_kernel_block_id_device_by_group[g])

    def forward(self, input_ids, sequence_lengths_plus_1, block_ids_by_group):
        n = input_ids.shape[0]
        bs = self.manager.dispatch(n)
        self.prepareInputs(input_ids, sequence_lengths_plus_1, block_ids_by_group)
        stale = {"input_ids": self.input_ids, "sequence_lengths_plus_1_d": self.sequence_lengths_plus_1_d}
        if self.variant == "bug":
            stale.update({f"kv_cache_kernel_block_id_device_by_group[{g}]": t
                          for g, t in enumerate(self.kv_cache_kernel_block_id_device_by_group)})
        return self.manager.replay(bs, n, padded=stale).clone()


def run(variant: str, device: str = "cpu"):
    model = Qwen3NextModel(device)
    prompts = {"A": [1, 2], "B": [3, 4], "C": [5, 6], "D": [7, 8], "E": [9, 10]}

    def serve(graphed: bool):
        ssm_states = torch.zeros(NUM_BLOCKS, DIM, DIM, device=device)
        runner = CudaGraphRunner(model, ssm_states, variant, device) if graphed else None
        alloc = BlockAllocator()
        tables, lengths, last = {}, {}, {}

        def prefill(name):
            tables[name] = [alloc.malloc() for _ in range(cal_block_idx(len(prompts[name]), SEQ_SIZE_PER_BLOCK) + 1)]
            model.prefill(prompts[name], tables[name], ssm_states)
            lengths[name], last[name] = len(prompts[name]), prompts[name][-1]

        def decode(names):
            for r in names:
                lengths[r] += 1
                while len(tables[r]) <= cal_block_idx(lengths[r], SEQ_SIZE_PER_BLOCK):
                    tables[r].append(alloc.malloc())
            ids = torch.tensor([last[r] for r in names], device=device)
            seq = torch.tensor([lengths[r] for r in names], device=device)
            table = torch.zeros(len(names), MAX_BLOCKS, dtype=torch.int64, device=device)
            for i, r in enumerate(names):
                table[i, :len(tables[r])] = torch.tensor(tables[r], device=device)
            by_group = [table, table]      # one allocation per request serves both groups here
            if graphed:
                logits = runner.forward(ids, seq, by_group)
            else:
                attention_inputs = PyAttentionInputs(seq, table, by_group, KV_CACHE_LAYER_TO_GROUP)
                logits = model.forward(ids, attention_inputs, ssm_states)
            for r in names:
                last[r] = (last[r] * 5 + 1) % VOCAB      # the sampled tokens (fixed here)
            return logits

        for name in "ABCD":
            prefill(name)
        outs = [decode(["A", "B", "C", "D"])]          # graph of size 4, no padding
        alloc.release(tables.pop("D"))                 # D finishes; E gets D's blocks
        prefill("E")
        outs.append(decode(["A", "B", "C"]))           # graph of size 4: row 3 is padded (D's old row)
        outs.append(decode(["A", "B", "C", "E"]))      # E decodes from its state
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
