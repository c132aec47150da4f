"""The decode graph's paged-attention workspace is sized at capture for ``max_model_len``; short contexts need more.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/3986 ("[main][bugfix] Fix a rare bug triggered by
_npu_paged_attention in FULL_DECODE_ONLY mode", commit e0d58d54).
Symptom: with ``FULL_DECODE_ONLY`` ACL graphs and GQA, a replayed ``_npu_paged_attention`` runs with a
workspace smaller than the step needs: a rare failure in some batches (the PR names no error message;
on the NPU the operator writes past the workspace), vllm-ascend v0.11, Nov 2025.
Mechanism: at capture the dummy run sets every ``seq_lens`` to ``max_model_len``, and the attention backend
sizes the paged-attention workspace once, from those lengths, and keeps it in ``graph_params.workspaces``
for the graph's size. Before each replay ``update_attn_params`` re-issues the captured attention task with
the step's real ``seq_lens`` but the capture's workspace. The operator's workspace is not monotonic in the
sequence lengths (here: shorter contexts are cut into more, smaller KV splits), so a batch of short
sequences needs more partial-result slots than the ``max_model_len`` capture asked for, and the operator
writes past the end of the workspace.
Doctor: undersized-buffer, at ``update_attn_params`` (the replay-time task update that hands the step's
lengths a workspace sized for the capture's).
Fix (upstream): ``update_attn_params`` calls ``_npu_paged_attention_get_workspace`` with the step's
``seq_lens`` and passes that workspace to the updated task.
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/3986"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "update_attn_params"
SYMPTOM = "paged attention writes past the end of the capture-sized workspace (out of range on the NPU)"
VOCAB, DIM, BLOCK, MAX_BLOCKS, MAX_REQS = 13, 4, 4, 4, 2
MAX_MODEL_LEN = BLOCK * MAX_BLOCKS
SCRATCH_BLOCK = MAX_REQS * MAX_BLOCKS
NUM_SLOTS = (SCRATCH_BLOCK + 1) * BLOCK
CAPTURE_SIZES = [2, 1]                         # decode batch sizes (FULL_DECODE_ONLY), largest first


def _pa_tiling(context_lens):
    """The paged-attention operator's KV split: long contexts in large chunks, short ones in small chunks
    (more splits, to keep the cores busy)."""
    max_len = max(context_lens)
    chunk = 2 * BLOCK if max_len > 2 * BLOCK else BLOCK // 2
    return chunk, -(-max_len // chunk)


def _npu_paged_attention_get_workspace(query, key_cache, value_cache, block_table, context_lens, out):
    _, num_splits = _pa_tiling(context_lens)
    return torch.empty(query.shape[0] * num_splits * (DIM + 2), device=query.device)


def _npu_paged_attention(query, key_cache, value_cache, block_table, context_lens, out, workspace=None):
    """Split-KV decode attention: one partial (max, sum, output) per split in ``workspace``, then combined."""
    if workspace is None:
        workspace = _npu_paged_attention_get_workspace(query, key_cache, value_cache, block_table,
                                                       context_lens, out)
    chunk, num_splits = _pa_tiling(context_lens)
    partials = workspace.view(-1, DIM + 2)
    for b, length in enumerate(context_lens):
        for s in range(num_splits):
            lo, hi = s * chunk, min((s + 1) * chunk, length)
            if lo < hi:
                pos = torch.arange(lo, hi, device=query.device)
                slots = block_table[b, pos // BLOCK] * BLOCK + pos % BLOCK
                scores = key_cache[slots] @ query[b] / DIM ** 0.5
                m = scores.max()
                p = torch.exp(scores - m)
                part = torch.cat([m[None], p.sum()[None], p @ value_cache[slots]])
            else:
                part = torch.cat([torch.full((1,), float("-inf"), device=query.device),
                                  torch.zeros(DIM + 1, device=query.device)])
            row = torch.tensor([b * num_splits + s], device=query.device)
            partials.index_copy_(0, row, part[None])            # the operator's write into its workspace
    for b in range(len(context_lens)):
        rows = partials[b * num_splits:(b + 1) * num_splits]
        w = torch.exp(rows[:, 0] - rows[:, 0].max())
        out[b] = (w[:, None] * rows[:, 2:]).sum(0) / (w * rows[:, 1]).sum()
    return out


class GraphParams:
    """``vllm_ascend.compilation.acl_graph`` graph params: per capture size, the workspace and the attention
    task's captured arguments."""

    def __init__(self):
        self.workspaces: dict[int, torch.Tensor] = {}
        self.attn_params: dict[int, tuple] = {}


class Model:
    def __init__(self, device):
        gen = generator(3986)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_MODEL_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)


class NPUModelRunner:
    def __init__(self, device, variant):
        self.device, self.variant = device, variant
        self.model = Model(device)
        self.key_cache = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.value_cache = torch.zeros(NUM_SLOTS, DIM, device=device)
        self.bufs = {"input_ids": torch.zeros(MAX_REQS, dtype=torch.long, device=device),
                     "positions": torch.zeros(MAX_REQS, dtype=torch.long, device=device),
                     "slot_mapping": torch.zeros(MAX_REQS, dtype=torch.long, device=device)}
        self.block_tables = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.attn_output = torch.zeros(MAX_REQS, DIM, device=device)     # the attention task's ``out``
        self.seq_lens_cpu: list[int] = []                                 # host lengths of the step
        self.graph_params = GraphParams()
        self.graphs: dict[int, tuple] = {}

    # ---------------------------------------------------------------- the model around attention
    def pre_attention(self, n):
        b = self.bufs
        h = self.model.emb[b["input_ids"][:n]] + self.model.pos[b["positions"][:n]]
        slots = b["slot_mapping"][:n]
        self.key_cache[slots] = h @ self.model.wk                     # reshape_and_cache
        self.value_cache[slots] = h @ self.model.wv
        return h @ self.model.wq

    def post_attention(self, n):
        return self.attn_output[:n] @ self.model.wo @ self.model.lm_head

    def _forward_decode_only(self, query, n, capturing=False):
        """The backend's decode path. While capturing, the workspace is sized once for the dummy lengths."""
        out = self.attn_output[:n]
        if not capturing:
            return _npu_paged_attention(query, self.key_cache, self.value_cache, self.block_tables[:n],
                                        self.seq_lens_cpu, out)
        workspace = self.graph_params.workspaces.get(n)
        if workspace is None:
            workspace = _npu_paged_attention_get_workspace(query, self.key_cache, self.value_cache,
                                                           self.block_tables[:n], self.seq_lens_cpu, out)
            self.graph_params.workspaces[n] = workspace
        self.graph_params.attn_params[n] = (query, self.key_cache, self.value_cache, self.block_tables[:n], out)
        return _npu_paged_attention(query, self.key_cache, self.value_cache, self.block_tables[:n],
                                    self.seq_lens_cpu, out, workspace=workspace)

    # ---------------------------------------------------------------- graphs
    def capture_model(self):
        """``_dummy_run`` per capture size: FULL decode metadata with ``seq_lens = max_model_len``."""
        events.persistent_state("NPUModelRunner", {"key_cache": self.key_cache, "value_cache": self.value_cache})
        pool = graph_pool_handle(self.device)
        for n in CAPTURE_SIZES:
            self.bufs["slot_mapping"].fill_(SCRATCH_BLOCK * BLOCK)
            self.bufs["positions"].zero_()
            self.block_tables.fill_(SCRATCH_BLOCK)
            self.seq_lens_cpu = [MAX_MODEL_LEN] * n
            g_pre, query = capture(lambda n=n: self.pre_attention(n), device=self.device, pool=pool,
                                   name=f"size {n} before attention", static=self.bufs, owner="NPUModelRunner")
            self._forward_decode_only(query, n, capturing=True)   # the captured attention task
            g_post, logits = capture(lambda n=n: self.post_attention(n), device=self.device, pool=pool,
                                     name=f"size {n} after attention", static={"attn_output": self.attn_output},
                                     owner="NPUModelRunner")
            self.graphs[n] = (g_pre, query, g_post, logits)

    def update_attn_params(self, runtime_shape):
        """Before the replay's attention task runs: re-issue it with this step's host ``seq_lens``."""
        query, key_cache, value_cache, block_table, output = self.graph_params.attn_params[runtime_shape]
        seq_lens = self.seq_lens_cpu
        if self.variant == "fix":
            workspace = _npu_paged_attention_get_workspace(query, key_cache, value_cache, block_table,
                                                           seq_lens, output)
        else:
            workspace = self.graph_params.workspaces.get(runtime_shape)
        _npu_paged_attention(query, key_cache, value_cache, block_table, seq_lens, output, workspace=workspace)

    # ---------------------------------------------------------------- serving
    def prefill(self, prompt, blocks):
        pos = torch.arange(len(prompt), device=self.device)
        slots = torch.tensor(blocks, device=self.device)[pos // BLOCK] * BLOCK + pos % BLOCK
        h = self.model.emb[torch.tensor(prompt, device=self.device)] + self.model.pos[pos]
        self.key_cache[slots] = h @ self.model.wk
        self.value_cache[slots] = h @ self.model.wv

    def _prepare_inputs(self, batch):
        n = len(batch)
        tokens = [t for t, _, _ in batch]
        positions = [p for _, p, _ in batch]
        slots = [bt[p // BLOCK] * BLOCK + p % BLOCK for _, p, bt in batch]
        self.bufs["input_ids"][:n] = torch.tensor(tokens, device=self.device)
        self.bufs["positions"][:n] = torch.tensor(positions, device=self.device)
        self.bufs["slot_mapping"][:n] = torch.tensor(slots, device=self.device)
        self.block_tables[:n] = torch.tensor([bt for _, _, bt in batch], device=self.device)
        self.seq_lens_cpu = [p + 1 for p in positions]
        return n

    def execute_model(self, batch):
        """A decode batch: per request (token, position, block table); replayed at its exact size."""
        n = self._prepare_inputs(batch)
        g_pre, query, g_post, logits = self.graphs[n]
        replay(g_pre, query)
        self.update_attn_params(n)
        return replay(g_post, logits).clone()

    def execute_model_eager(self, batch):
        n = self._prepare_inputs(batch)
        self._forward_decode_only(self.pre_attention(n), n)
        return self.post_attention(n).clone()


def schedule():
    """Two long requests decode one step and finish; two short requests take their blocks and decode."""
    long_prompts = ([3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])
    short_prompts = ([6, 2, 8], [3, 3, 8, 3])
    blocks = ([0, 1, 2, 3], [4, 5, 6, 7])
    phases = [(long_prompts, [[(7, 9, blocks[0]), (11, 10, blocks[1])]]),
              (short_prompts, [[(4, 3, blocks[0]), (12, 4, blocks[1])],
                               [(5, 4, blocks[0]), (0, 5, blocks[1])]])]
    return blocks, phases


def run(variant: str, device: str = "cpu"):
    blocks, phases = schedule()

    def serve(graphed):
        runner = NPUModelRunner(device, variant)
        if graphed:
            runner.capture_model()
        outs = []
        with torch.no_grad():
            for prompts, steps in phases:
                for prompt, bt in zip(prompts, blocks):
                    runner.prefill(prompt, bt)
                for batch in steps:
                    outs.append(runner.execute_model(batch) if graphed else runner.execute_model_eager(batch))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
