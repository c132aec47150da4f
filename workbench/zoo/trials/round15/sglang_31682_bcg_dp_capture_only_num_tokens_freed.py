"""Breakable prefill graphs under DP attention keep the address of a capture-only ``global_num_tokens_gpu``.

Upstream: https://github.com/sgl-project/sglang/pull/31682 (the ``PrefillCudaGraphRunner`` change that
passes the capture batch to ``BreakableCudaGraphBackend.capture_one`` as ``capture_inputs``; follow-up
#32678, "[cuda_graph] Gate breakable-CG capture_inputs retention to DP-gather paths", describes it).
Symptom: with DP attention (or MoE/MLP data parallelism) and breakable prefill CUDA graphs, prefills that
replay a captured token bucket produce wrong hidden states for part of their tokens (or an illegal memory
access, depending on the allocator's layout); eager prefill is fine (sglang main, July 2026). No user
report is quoted; the symptom follows from the change.
Mechanism: ``PrefillCudaGraphRunner.capture_prepare`` builds a dummy ``ForwardBatch`` per token bucket.
Under DP padding it creates ``global_num_tokens_gpu = torch.tensor([num_tokens] * dp_size)`` as a fresh
tensor that is no static buffer of the runner ("capture-only"). The captured DP gather/scatter kernels read
it (``get_dp_local_info``: this rank's start offset and token count in the gathered buffer), so the graph
keeps its address. ``capture_one_shape`` then drops the batch: the tensor is freed and the caching allocator
hands the block to a later allocation of the same size. From then on every replay reads that allocation's
bytes as this rank's offset and token count, so the gather/scatter around the MLP puts this rank's tokens in
the wrong rows of the gathered buffer (or outside it) and brings back wrong rows: the first prefill after
capture is still right, the later ones are not.
Doctor: dangling-reference, at ``capture_one_shape`` (the captured graph reads a tensor of the capture
batch, which nothing keeps alive after capture).
Fix (upstream): ``capture_one_shape`` passes ``capture_inputs=forward_batch`` and the breakable backend
retains it per shape key (``self._capture_inputs[shape_key]``), so the recorded addresses stay valid.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph, reuse_freed_blocks
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/31682"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "capture_one_shape"
SYMPTOM = "prefill graph replays gather/scatter with token counts read from a freed, reused block: wrong hidden states"
VOCAB, HIDDEN, DP_SIZE, DP_RANK = 11, 4, 2, 1
CAPTURE_NUM_TOKENS = [4, 8]


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    global_num_tokens_gpu: torch.Tensor | None = None
    global_num_tokens_cpu: list | None = None
    global_dp_buffer_len: int | None = None
    dp_local_start_pos: torch.Tensor | None = None
    dp_local_num_tokens: torch.Tensor | None = None


def get_dp_local_info(forward_batch: ForwardBatch):
    """This rank's slice of the gathered buffer, computed on the device from ``global_num_tokens_gpu``."""
    if forward_batch.dp_local_start_pos is None:
        cumtokens = torch.cumsum(forward_batch.global_num_tokens_gpu, dim=0)
        if DP_RANK == 0:
            local_start_pos = torch.zeros_like(cumtokens[0])
        else:
            local_start_pos = cumtokens[DP_RANK - 1]
        local_num_tokens = forward_batch.global_num_tokens_gpu[DP_RANK]
        forward_batch.dp_local_start_pos = local_start_pos
        forward_batch.dp_local_num_tokens = local_num_tokens
    return forward_batch.dp_local_start_pos, forward_batch.dp_local_num_tokens


def memcpy_triton(dst, src, offset, sz, offset_src: bool):
    """``memcpy_triton_kernel``: copy ``sz`` rows, at ``offset`` of ``src`` (or of ``dst``); offset and size
    are device scalars the kernel loads, so a graph re-reads them at every replay."""
    if offset_src:
        idx = torch.arange(dst.shape[0], device=dst.device)
        rows = src[(offset + idx).clamp(max=src.shape[0] - 1)]
        dst.copy_(torch.where((idx < sz)[:, None], rows, dst))
    else:
        idx = torch.arange(src.shape[0], device=src.device)
        pos = offset + idx
        keep = dst[pos.clamp(max=dst.shape[0] - 1)]
        dst.index_put_((pos.clamp(max=dst.shape[0] - 1),), torch.where((idx < sz)[:, None], src, keep))


def tensor_model_parallel_all_reduce(x):
    """One process stands in for the DP group: the other ranks add their own rows, none of ours."""
    return x


def dp_gather_partial(global_tokens, local_tokens, forward_batch):
    global_tokens.fill_(0)
    local_start_pos, local_num_tokens = get_dp_local_info(forward_batch)
    memcpy_triton(global_tokens, local_tokens, local_start_pos, local_num_tokens, False)
    return tensor_model_parallel_all_reduce(global_tokens)


def dp_scatter(local_tokens, global_tokens, forward_batch):
    local_start_pos, local_num_tokens = get_dp_local_info(forward_batch)
    local_tokens.fill_(0)
    memcpy_triton(local_tokens, global_tokens, local_start_pos, local_num_tokens, True)
    return local_tokens


class DeepseekV2ForCausalLM:
    """Attention is data-parallel, the MLP runs on the tokens gathered from every DP rank."""

    def __init__(self, device):
        gen = generator(31682)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_emb = randn(16, HIDDEN, gen=gen, device=device, scale=0.3)
        self.w_up = randn(HIDDEN, 2 * HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_down = randn(2 * HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward(self, forward_batch: ForwardBatch):
        hidden_states = self.embed_tokens[forward_batch.input_ids] + self.pos_emb[forward_batch.positions]
        global_hidden = torch.zeros(forward_batch.global_dp_buffer_len, HIDDEN, device=hidden_states.device)
        global_hidden = dp_gather_partial(global_hidden, hidden_states, forward_batch)
        global_hidden = torch.relu(global_hidden @ self.w_up) @ self.w_down
        mlp_out = dp_scatter(torch.empty_like(hidden_states), global_hidden, forward_batch)
        return hidden_states + mlp_out


class BreakableCudaGraphBackend:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.pool = graph_pool_handle(device)
        self.graphs, self.outputs = {}, {}
        self._capture_inputs = {}

    def capture_one(self, shape_key: int, run_once, capture_inputs=None, static=None):
        """Warm up, capture, keep the graph and its output; ``run_once`` itself is not kept."""
        events.static_buffers("PrefillCudaGraphRunner (breakable)", static or {})
        with events.warmup():
            run_once()
        g = new_graph(self.device, on_freed="reuse")
        with graph(g, pool=self.pool, name=f"prefill num_tokens={shape_key}"):
            out = run_once()
        self.graphs[shape_key], self.outputs[shape_key] = g, out
        if capture_inputs is not None:
            self._capture_inputs[shape_key] = capture_inputs    # keep capture-only tensors alive

    def replay(self, shape_key: int, real: int):
        g, out = self.graphs[shape_key], self.outputs[shape_key]
        events.serve(g, real, shape_key, outputs=out)
        g.replay()
        view = out.view_as(out)
        events.handed_out(g, view)
        return view


class PrefillCudaGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.capture_num_tokens = CAPTURE_NUM_TOKENS
        max_num_tokens = max(CAPTURE_NUM_TOKENS)
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.backend = BreakableCudaGraphBackend(device, variant)
        for num_tokens in reversed(self.capture_num_tokens):
            self.capture_one_shape(num_tokens)

    def capture_prepare(self, num_tokens: int) -> ForwardBatch:
        global_num_tokens_cpu = [num_tokens] * DP_SIZE              # require_mlp_tp_gather
        num_tokens_tensor = torch.tensor(global_num_tokens_cpu, dtype=torch.int32, device=self.device)
        return ForwardBatch(input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens],
                            global_num_tokens_gpu=num_tokens_tensor, global_num_tokens_cpu=global_num_tokens_cpu,
                            global_dp_buffer_len=sum(global_num_tokens_cpu))

    def capture_one_shape(self, size: int) -> None:
        num_tokens = size
        forward_batch = self.capture_prepare(num_tokens)

        def run_once():
            forward_batch.dp_local_start_pos = forward_batch.dp_local_num_tokens = None
            return self.model.forward(forward_batch)

        static = {"input_ids": self.input_ids, "positions": self.positions}
        if self.variant == "bug":
            self.backend.capture_one(num_tokens, run_once, static=static)
        else:
            # DP padding can install capture-only tensors on this dummy batch;
            # BCG retains it so their recorded addresses remain valid.
            self.backend.capture_one(num_tokens, run_once, capture_inputs=forward_batch, static=static)

    def replay(self, input_ids, positions):
        num_tokens = input_ids.shape[0]
        static_num_tokens = next(n for n in self.capture_num_tokens if n >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.input_ids[num_tokens:].zero_()
        self.positions[:num_tokens].copy_(positions)
        self.positions[num_tokens:].zero_()
        return self.backend.replay(static_num_tokens, num_tokens)[:num_tokens].clone()


def run(variant: str, device: str = "cpu"):
    model = DeepseekV2ForCausalLM(device)
    gen = torch.Generator().manual_seed(5)
    # (this rank's prompt tokens, the other DP rank's token count)
    prefills = [(torch.randint(1, VOCAB, (n,), generator=gen), other) for n, other in ((6, 5), (3, 2), (7, 8))]

    def eager():
        outs = []
        for ids, other in prefills:
            ids = ids.to(device)
            global_num_tokens_cpu = [other, len(ids)]
            fb = ForwardBatch(input_ids=ids, positions=torch.arange(len(ids), device=device),
                              global_num_tokens_gpu=torch.tensor(global_num_tokens_cpu, dtype=torch.int32,
                                                                 device=device),
                              global_num_tokens_cpu=global_num_tokens_cpu,
                              global_dp_buffer_len=sum(global_num_tokens_cpu))
            outs.append(model.forward(fb))
        return outs

    def served():
        with reuse_freed_blocks():                  # the caching allocator hands freed blocks on
            runner = PrefillCudaGraphRunner(model, device, variant)
            # every DP rank pads to the same bucket: the captured counts are the right ones for it
            return [runner.replay(ids.to(device), torch.arange(len(ids), device=device)) for ids, _ in prefills]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
