"""Qwen3-TTS ``forward_depth`` picks its codebook head with ``position_ids.max().item()`` inside the captured forward.

Upstream: https://github.com/vox-serve/vox-serve/commit/a7a53059968db52099183460a9dbd5c4b27c34dc
("fix: cuda graph issue for qwen3 tts", a direct commit on main, no PR; whole diff read, with ``forward_depth``,
``Qwen3TTSTalkerCodePredictorModelForConditionalGeneration.__init__`` and
``CudaGraphWorker._initialize_depth_cuda_graphs`` / ``run_lm_depth`` at its parent 5db60db).
Symptom: no thread; the parent commit says "custom voice working without cuda graph". With the CUDA-graph
worker the depth-transformer graphs cannot be captured: the ``.item()`` is a host synchronisation, which a
capturing stream refuses ("operation not permitted when stream is capturing"), so the worker fails at start-up.
Mechanism: ``_initialize_depth_cuda_graphs`` runs 5 eager warmups and then captures, under
``torch.cuda.graph(depth_graph_prefill, pool=self.cuda_graph_pool)``, ``self.model.depth_forward(
hidden_states=buffers["depth_hidden_states"][:2*bs], position_ids=buffers["depth_position_ids"][:2*bs], ...)``
followed by a copy into ``buffers["depth_logits"]`` (then the same for the decode graph, ``[:bs]``).
``Qwen3TTSForCausalLM.forward_depth`` chose the per-codebook head on the host:
``head_idx = position_ids.max().int().item(); logits = self.talker.code_predictor.lm_head[head_idx - 1](h)``.
The eager warmups get through (the positions are zeros: ``lm_head[-1]``); inside the capture the ``.item()``
synchronises the capturing stream and the capture fails. (Had it got through, the graph would replay the
head chosen at capture for every depth step: ``run_lm_depth`` writes positions ``[0, 1]`` for step 1 and
``[i]`` for step ``i`` into the static ``depth_position_ids``, and step ``i`` needs ``lm_head[i - 1]``.)
Doctor: sync-in-capture, at forward_depth (its ``.item()`` on the static position buffer synchronises the
stream inside the depth graphs' capture).
Fix (upstream): ``forward_depth`` selects the head with tensor ops that the graph replays:
``head_idx = position_ids.max().clamp(min=1, max=num_heads).sub(1).to(torch.long).view(1)``,
``head_weight = lm_head_weight.index_select(0, head_idx).squeeze(0)``, ``logits = hidden_states @ head_weight.t()``;
and ``Qwen3TTSModel.__init__``, after loading the checkpoint and ``.to(device)``, refreshes the stacked buffer
(``lm_head_weight.copy_(torch.stack([head.weight for head in lm_head], dim=0))``): it was registered in
``__init__`` from the freshly initialised heads, so without the refresh the tensor path would use random heads.
Simplifications: one batch bucket (2 requests, no padding), one tiny decoder layer whose position dependence
is a learned table (for RoPE), no depth KV cache / flashinfer wrappers, greedy ``depth_sampling``.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vox-serve/vox-serve/commit/a7a53059968db52099183460a9dbd5c4b27c34dc"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward_depth"
SYMPTOM = "depth-transformer CUDA graph capture fails on a host .item() choosing the codebook head"

HIDDEN, DEPTH_VOCAB, NUM_CODE_GROUPS = 8, 12, 5     # depth_n_codebooks = NUM_CODE_GROUPS
BATCH = 2                                           # cuda_graph_batch_sizes = [2], 2 real requests
EPS = 1e-6


class Qwen3TTSTalkerCodePredictorModelForConditionalGeneration:
    def __init__(self, device, gen):
        # __init__: heads at their (random) initialisation, and the stacked buffer made from them now
        self.w_layer = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.pos_table = randn(NUM_CODE_GROUPS + 1, HIDDEN, gen=gen, device=device, scale=0.5)
        self.norm_weight = torch.ones(HIDDEN, device=device)
        self.lm_head = [randn(DEPTH_VOCAB, HIDDEN, gen=gen, device=device, scale=0.02)
                        for _ in range(NUM_CODE_GROUPS - 1)]              # nn.Linear(...).weight
        self.lm_head_weight = torch.stack(self.lm_head, dim=0)          # register_buffer("lm_head_weight", ...)
        self.codec_embedding = [randn(DEPTH_VOCAB, HIDDEN, gen=gen, device=device)
                                for _ in range(NUM_CODE_GROUPS - 1)]

    def load_state_dict(self, state_dict):
        """``load_state_dict(strict=False)``: the heads get the checkpoint; the stacked buffer is not in it."""
        for i, w in enumerate(state_dict["lm_head"]):
            self.lm_head[i].copy_(w)

    def forward(self, inputs_embeds, position_ids):
        """``self.model(...)``: one decoder layer and the final RMSNorm."""
        h = inputs_embeds + torch.tanh((inputs_embeds + self.pos_table[position_ids.long()]) @ self.w_layer)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * self.norm_weight


class Qwen3TTSForCausalLM:
    def __init__(self, device, gen, variant):
        self.variant = variant
        self.code_predictor = Qwen3TTSTalkerCodePredictorModelForConditionalGeneration(device, gen)

    def forward_depth(self, inputs_embeds, position_ids):
        hidden_states = self.code_predictor.forward(inputs_embeds, position_ids)
        if self.variant == "bug":
            head_idx = position_ids.max().int().item()                  # host sync: refused inside a capture
            return hidden_states @ self.code_predictor.lm_head[head_idx - 1].t()
        # a7a5305: the head chosen with tensor ops, which the graph replays
        num_heads = self.code_predictor.lm_head_weight.shape[0]
        head_idx = position_ids.max()
        head_idx = head_idx.clamp(min=1, max=num_heads).sub(1).to(torch.long).view(1)
        head_weight = self.code_predictor.lm_head_weight.index_select(0, head_idx).squeeze(0)
        return hidden_states @ head_weight.t()


class Qwen3TTSModel:
    def __init__(self, device, variant):
        gen = generator(5305)
        self.model = Qwen3TTSForCausalLM(device, gen, variant)
        checkpoint = {"lm_head": [randn(DEPTH_VOCAB, HIDDEN, gen=gen, device=device)
                                  for _ in range(NUM_CODE_GROUPS - 1)]}
        self.model.code_predictor.load_state_dict(checkpoint)
        if variant == "fix":
            # a7a5305: sync the lm_head_weight buffer with the loaded weights for CUDA graph compatibility
            cp = self.model.code_predictor
            cp.lm_head_weight.copy_(torch.stack([head for head in cp.lm_head], dim=0))

    def depth_forward(self, hidden_states, position_ids):
        return self.model.forward_depth(inputs_embeds=hidden_states, position_ids=position_ids)

    def depth_sampling(self, logits, i_iteration):
        output_ids = logits.argmax(-1)                                    # greedy Sampler.run_sampling
        return output_ids, self.model.code_predictor.codec_embedding[i_iteration - 1][output_ids]


class CudaGraphWorker:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.cuda_graph_pool = graph_pool_handle(device)
        self.cuda_graph_buffers = {
            "depth_hidden_states": torch.zeros(2 * BATCH, HIDDEN, device=device),
            "depth_position_ids": torch.zeros(2 * BATCH, dtype=torch.int32, device=device),
            "depth_logits": torch.zeros(2 * BATCH, DEPTH_VOCAB, device=device),
        }
        self._initialize_depth_cuda_graphs()

    def _capture(self, rows, name):
        b = self.cuda_graph_buffers

        def depth_step():
            out = self.model.depth_forward(hidden_states=b["depth_hidden_states"][:rows],
                                           position_ids=b["depth_position_ids"][:rows])
            b["depth_logits"][:rows].copy_(out)
            return b["depth_logits"][:rows]

        return capture(depth_step, device=self.device, pool=self.cuda_graph_pool, warmups=5, name=name,
                       owner="CudaGraphWorker (depth graphs)",
                       static={"depth_hidden_states": b["depth_hidden_states"],
                               "depth_position_ids": b["depth_position_ids"]})

    def _initialize_depth_cuda_graphs(self):
        self.depth_prefill = self._capture(2 * BATCH, f"depth prefill bs={BATCH}")
        self.depth_decode = self._capture(BATCH, f"depth decode bs={BATCH}")

    def run_lm_depth(self, hidden_for_depth):
        """``hidden_for_depth``: [bs, 2, hidden]. Returns each depth step's logits (taken at the last token)."""
        b, outs = self.cuda_graph_buffers, []
        depth_position_ids = torch.tensor([0, 1] * BATCH, dtype=torch.int32).to(self.device)
        for i in range(1, NUM_CODE_GROUPS):
            if i > 1:
                g, out = self.depth_decode
                b["depth_hidden_states"][:BATCH].copy_(hidden_for_depth)
                b["depth_position_ids"][:BATCH].copy_(depth_position_ids)
                depth_logits = replay(g, out)[:BATCH]
            else:
                g, out = self.depth_prefill
                b["depth_hidden_states"][: 2 * BATCH].copy_(hidden_for_depth.reshape(2 * BATCH, -1))
                b["depth_position_ids"][: 2 * BATCH].copy_(depth_position_ids)
                depth_logits = replay(g, out)[1::2]                        # qo_indptr[1:] - 1
            outs.append(depth_logits.clone())
            _, hidden_for_depth = self.model.depth_sampling(depth_logits, i)
            depth_position_ids = torch.full((BATCH,), i + 1, dtype=torch.int32).to(self.device)
        return outs


def run_lm_depth_eager(model, hidden_for_depth, device):
    """The worker without CUDA graphs: ``depth_forward`` called directly at each depth step."""
    outs = []
    position_ids = torch.tensor([0, 1] * BATCH, dtype=torch.int32).to(device)
    hidden = hidden_for_depth.reshape(2 * BATCH, -1)
    for i in range(1, NUM_CODE_GROUPS):
        logits = model.depth_forward(hidden, position_ids)
        logits = logits[1::2] if i == 1 else logits
        outs.append(logits.clone())
        _, hidden = model.depth_sampling(logits, i)
        position_ids = torch.full((BATCH,), i + 1, dtype=torch.int32).to(device)
    return outs


def run(variant: str, device: str = "cpu"):
    gen = generator(3)
    frames = [randn(BATCH, 2, HIDDEN, gen=gen, device=device) for _ in range(3)]   # talker output per frame

    def eager():
        model = Qwen3TTSModel(device, variant)
        return [t for f in frames for t in run_lm_depth_eager(model, f, device)]

    def served():
        worker = CudaGraphWorker(Qwen3TTSModel(device, variant), device)
        return [t for f in frames for t in worker.run_lm_depth(f)]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
