"""vLLM-Ascend FULL_DECODE_ONLY graphs: ``update_graph_params`` pairs the attention tasks captured in layer order with
the layers of ``forward_context.attn_metadata`` in its dict order; when that order is not the layer order, a layer's
captured attention is re-issued with another layer's block table and reads the wrong KV blocks.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/9322 ("[BugFix] Fix the accuracy issue in DFlash
FULL_DESCODE_ONLY mode caused by attn group sorting", vllm-project/vllm-ascend, merged 2026-05-21 as commit de00758e48).
Read: the PR description ("In some speculative methods (such as DFlash), the order of attn_keys in the Target model will
be disrupted instead of increasing by layer index, so need regular expressions to reorder the attn_keys and stor the
results in _ATTN_KEYS_BUFFER"), its diff in ``AscendAttentionBackendImpl.update_graph_params`` (FIA branch: sort the
first ``len(graph_params.attn_params[num_tokens])`` keys by the layer index their name carries, computed once into the
module global ``_ATTN_KEYS_BUFFER``), and at the parent commit ``vllm_ascend/attention/attention_v1.py``
(``update_graph_params`` zipping ``attn_keys`` with ``graph_params.attn_params[num_tokens]`` / handles / events and
re-issuing ``npu_fused_infer_attention_score.out`` with ``attn_metadata[key].seq_lens_list``, ``actual_seq_lengths_q`` and
``block_tables``; ``full_graph_fia`` appending each layer's params to ``graph_params.attn_params[num_tokens]`` while it is
captured, i.e. in execution order), ``vllm_ascend/compilation/acl_graph.py`` (``update_full_graph_params``) and
``NPUModelRunner._model_forward`` / ``_update_full_graph_params_if_needed`` (update only for FULL runtime mode, not while
capturing). Reconstructed: why the dict order differs (the PR names DFlash only; here the runner fills
``attn_metadata`` KV-cache group by group, two groups with their own blocks, so the keys come as layers 0, 2, 1, 3), the
model and the graph-task mechanics (below).
Symptom: accuracy loss (wrong tokens) with the FULL_DECODE_ONLY ACL graph under DFlash; eager mode and capture itself
are fine.
Mechanism: an ACL graph bakes each FIA task's host arguments (KV lengths, block table) at capture; before every replay
``update_graph_params`` re-issues task ``i`` with the metadata of ``attn_keys[i]``. The tasks are in execution (layer)
order, ``attn_keys`` in the metadata dict's order. With the keys not in layer order, the task of layer 1 (second KV
group) is given layer 2's metadata (first group's block table) and reads its own group's cache at the other group's
block ids: blocks that hold other requests' keys or nothing. Eagerly every layer looks its metadata up by its own name.
Doctor: warmup-divergence, at update_graph_params. Capture fixed which layer each graph task belongs to (execution
order); the eager update step pairs the tasks with layers by the dict order instead, so the replayed attention of a
layer runs with parameters decided for another layer.
Fix (upstream): sort the keys by layer index (``extract_layer_index``) before zipping them with the captured tasks.
Modelled: ``AscendAttentionBackendImpl`` (``forward`` choosing ``full_graph_fia`` in FULL runtime mode, ``full_graph_fia``
recording ``attn_params`` in execution order, ``update_graph_params`` with the upstream zip and fix),
``GraphParams``/``get_graph_params``, ``update_full_graph_params``, ``NPUModelRunner`` (``_build_attention_metadata``
per KV-cache group with persistent block-table / seq-len / slot-mapping buffers, ``_model_forward`` with the update,
``_dummy_run``/``capture_model``, decode batches padded to ``cudagraph_capture_sizes``), an ``ACLGraphWrapper``
capturing the whole model per batch descriptor. Stand-ins: each graph task's host arguments are a per-task static
buffer the update writes (the emulation's form of ``graph_task_update_begin/end``), written before the replay (the
``enable_enpu`` order; by default upstream issues them right after launching the replay, whose tasks wait on events);
FIA is a paged-attention in torch over a block table (block size 4, block 0 the null block); a 4-layer decoder (hidden 8,
vocab 16, one head, float64) with tanh-MLP; greedy sampling on the host.
Workload: capture sizes [2, 4]; A (5 tokens) and B (3 tokens) prefill eagerly, A and B decode (graph 2), C (4 tokens)
prefills, then A, B, C decode three times (graph 4, one padded row). The bug's decode logits differ from eager from the
first replay on (layers 1 and 2 attend over the other group's block ids; max error 90.3 on the CPU); the fix equals eager
on every step (logits of all scheduled tokens compared).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/9322"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update_graph_params"
SYMPTOM = ("FULL_DECODE_ONLY ACL graphs lose accuracy (DFlash): the per-step graph-parameter update pairs the attention "
           "tasks captured in layer order with the attention metadata in dict order, so a layer's attention is re-issued "
           "with another KV-cache group's block table")

HIDDEN = 8
VOCAB = 16
NUM_LAYERS = 4
BLOCK_SIZE = 4
MAX_BLOCKS = 4                      # blocks per request
NUM_BLOCKS = 16                     # per KV-cache group; block 0 is the null block
MAX_NUM_REQS = 4
MAX_NUM_TOKENS = 16
MAX_POSITION = MAX_BLOCKS * BLOCK_SIZE
CUDAGRAPH_CAPTURE_SIZES = [2, 4]
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
KV_CACHE_GROUPS = [[0, 2], [1, 3]]  # two groups with their own block tables

_variant = "bug"
_ATTN_KEYS_BUFFER = None


# --- forward context and graph params -----------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    attn_metadata: dict
    cudagraph_runtime_mode: str
    num_tokens: int
    num_actual_tokens: int
    capturing: bool = False


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextlib.contextmanager
def set_ascend_forward_context(attn_metadata, *, num_tokens, num_actual_tokens, aclgraph_runtime_mode):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, aclgraph_runtime_mode, num_tokens, num_actual_tokens)
    try:
        yield
    finally:
        _forward_context = prev


@dataclasses.dataclass
class AttnParams:
    """What a captured FIA task was issued with: tensors by address, and its host arguments (here a static buffer each,
    which ``update_graph_params`` rewrites as graph_task_update re-issues the task)."""
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    output: torch.Tensor


class GraphParams:
    def __init__(self):
        self.attn_params: dict[int, list[AttnParams]] = {}
        self.task_args: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def prepare(self, num_tokens, device):
        self.attn_params[num_tokens] = []
        self.task_args[num_tokens] = [
            (torch.zeros(num_tokens, MAX_BLOCKS, dtype=torch.int64, device=device),
             torch.ones(num_tokens, dtype=torch.int64, device=device)) for _ in range(NUM_LAYERS)]


_graph_params: GraphParams | None = None


def get_graph_params() -> GraphParams:
    return _graph_params


# --- attention ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class AscendMetadata:
    block_tables: torch.Tensor      # [num_reqs, MAX_BLOCKS]
    seq_lens: torch.Tensor          # [num_reqs]
    slot_mapping: torch.Tensor      # [num_tokens]
    token_req_indices: torch.Tensor  # [num_tokens]
    positions: torch.Tensor         # [num_tokens]


def npu_fused_infer_attention_score(query, key_cache, value_cache, block_tables, seq_lens, req_indices, positions):
    """Stand-in FIA (paged, one head): token t attends positions <= positions[t] (< seq_lens) of its request's blocks."""
    pos = torch.arange(MAX_POSITION, device=query.device)
    tables = block_tables[req_indices]                                       # [T, MAX_BLOCKS]
    slots = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE      # [T, MAX_POSITION]
    keys, values = key_cache[slots], value_cache[slots]                      # [T, MAX_POSITION, H]
    scores = (keys @ query.unsqueeze(-1)).squeeze(-1) / HIDDEN ** 0.5
    visible = (pos[None, :] <= positions[:, None]) & (pos[None, :] < seq_lens[req_indices][:, None])
    scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1).unsqueeze(-1) * values).sum(dim=1)


class AscendAttentionBackendImpl:
    def forward(self, layer_name, query, key, value, kv_cache, attn_metadata, output):
        key_cache, value_cache = kv_cache
        key_cache.index_copy_(0, attn_metadata.slot_mapping, key)              # reshape_and_cache
        value_cache.index_copy_(0, attn_metadata.slot_mapping, value)
        forward_context = get_forward_context()
        if forward_context.cudagraph_runtime_mode == "FULL":
            return self.full_graph_fia(query, key_cache, value_cache, attn_metadata, output)
        output.copy_(npu_fused_infer_attention_score(query, key_cache, value_cache, attn_metadata.block_tables,
                                                     attn_metadata.seq_lens, attn_metadata.token_req_indices,
                                                     attn_metadata.positions))
        return output

    def full_graph_fia(self, query, key_cache, value_cache, attn_metadata, output):
        num_tokens = query.shape[0]
        graph_params = get_graph_params()
        block_tables, seq_lens = graph_params.task_args[num_tokens][len(graph_params.attn_params[num_tokens])]
        graph_params.attn_params[num_tokens].append(
            AttnParams(query, key_cache, value_cache, block_tables, seq_lens, output))
        output.copy_(npu_fused_infer_attention_score(query, key_cache, value_cache, block_tables, seq_lens,
                                                     attn_metadata.token_req_indices, attn_metadata.positions))
        return output

    @staticmethod
    def update_graph_params(update_stream, forward_context, num_tokens, vllm_config=None):
        graph_params = get_graph_params()
        attn_metadata = forward_context.attn_metadata
        attn_keys = list(attn_metadata.keys())
        if _variant == "fix":
            attn_keys_length = len(graph_params.attn_params[num_tokens])
            global _ATTN_KEYS_BUFFER
            if _ATTN_KEYS_BUFFER is None:
                def extract_layer_index(key: str) -> int:
                    match = re.search(r"(\d+)", key)
                    return int(match.group(1)) if match else 0

                attn_keys_tmp = attn_keys[:attn_keys_length]
                attn_keys_tmp.sort(key=extract_layer_index)
                _ATTN_KEYS_BUFFER = attn_keys_tmp
            attn_keys[:attn_keys_length] = _ATTN_KEYS_BUFFER
        for key, param in zip(attn_keys, graph_params.attn_params[num_tokens]):
            # graph_task_update_begin / npu_fused_infer_attention_score.out(...) / graph_task_update_end
            param.block_tables.copy_(attn_metadata[key].block_tables)
            param.seq_lens.copy_(attn_metadata[key].seq_lens)


def update_full_graph_params(attn_backend, update_stream, forward_context, num_tokens, vllm_config=None):
    attn_backend.update_graph_params(update_stream, forward_context, num_tokens, vllm_config)


# --- model ---------------------------------------------------------------------------------------------------------------

class TargetModel:
    def __init__(self, device):
        gen = generator(9322)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.pos_embed = r(MAX_POSITION, HIDDEN, scale=0.3)
        self.layers = [dict(qkv=r(HIDDEN, 3 * HIDDEN), o=r(HIDDEN, HIDDEN), w1=r(HIDDEN, HIDDEN), w2=r(HIDDEN, HIDDEN))
                       for _ in range(NUM_LAYERS)]
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.attn = AscendAttentionBackendImpl()
        self.kv_caches = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, dtype=torch.float64, device=device),
                           torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, dtype=torch.float64, device=device))
                          for _ in range(NUM_LAYERS)]

    def __call__(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
        attn_metadata = get_forward_context().attn_metadata
        x = self.embed_tokens[input_ids] + self.pos_embed[positions]
        for i, (layer_name, w) in enumerate(zip(LAYER_NAMES, self.layers)):
            q, k, v = (x @ w["qkv"]).split(HIDDEN, dim=-1)
            out = torch.empty_like(q)
            self.attn.forward(layer_name, q, k, v, self.kv_caches[i], attn_metadata[layer_name], out)
            x = x + out @ w["o"]
            x = x + torch.tanh(x @ w["w1"]) @ w["w2"]
        return x

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class ACLGraphWrapper:
    def __init__(self, runnable, runner):
        self.runnable, self.runner = runnable, runner
        self.concrete_aclgraph_entries = {}
        self.graph_pool = graph_pool_handle(runner.device)

    def __getattr__(self, name):
        return getattr(self.runnable, name)

    def __call__(self, *args, **kwargs):
        ctx = get_forward_context()
        if ctx.cudagraph_runtime_mode != "FULL":
            return self.runnable(*args, **kwargs)
        r = self.runner
        entry = self.concrete_aclgraph_entries.get(ctx.num_tokens)
        static = {"input_ids": r.input_ids, "positions": r.positions, "token_req_indices": r.token_req_indices}
        for g, buf in enumerate(r.group_buffers):
            static.update({f"block_table_{g}": buf["block_table"], f"seq_lens_{g}": buf["seq_lens"],
                           f"slot_mapping_{g}": buf["slot_mapping"]})
        if entry is None:
            get_graph_params().prepare(ctx.num_tokens, r.device)
            for i, (bt, sl) in enumerate(get_graph_params().task_args[ctx.num_tokens]):
                static.update({f"task{i}_block_tables": bt, f"task{i}_seq_lens": sl})
            ctx.capturing = True
            entry = capture(lambda: self.runnable(*args, **kwargs), device=r.device, pool=self.graph_pool, warmups=0,
                            name=f"model [{ctx.num_tokens}]", owner="NPUModelRunner", static=static,
                            state={f"kv_cache_{i}_{j}": c for i, kv in enumerate(self.runnable.kv_caches)
                                   for j, c in enumerate(kv)})
            ctx.capturing = False
            self.concrete_aclgraph_entries[ctx.num_tokens] = entry
            return entry[1]
        g, output = entry
        return replay(g, output, real=ctx.num_actual_tokens, size=ctx.num_tokens)


# --- runner --------------------------------------------------------------------------------------------------------------

class NPUModelRunner:
    def __init__(self, device, enforce_eager):
        global _graph_params
        _graph_params = GraphParams()
        self.device = device
        self.use_graph = not enforce_eager
        self.cudagraph_batch_sizes = sorted(CUDAGRAPH_CAPTURE_SIZES)
        z = lambda *s: torch.zeros(*s, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.token_req_indices = z(MAX_NUM_TOKENS), z(MAX_NUM_TOKENS), z(MAX_NUM_TOKENS)
        self.group_buffers = [dict(block_table=z(MAX_NUM_REQS, MAX_BLOCKS), seq_lens=z(MAX_NUM_REQS),
                                   slot_mapping=z(MAX_NUM_TOKENS)) for _ in KV_CACHE_GROUPS]
        self.model = TargetModel(device)
        self.attn_backend = AscendAttentionBackendImpl
        self.update_stream = None
        if self.use_graph:
            self.model = ACLGraphWrapper(self.model, self)
        # per group block allocation: group 0 hands out blocks from the bottom, group 1 from the top
        self.free_blocks = [list(range(1, NUM_BLOCKS)), list(range(NUM_BLOCKS - 1, 0, -1))]
        self.req_blocks = {}

    def add_request(self, name):
        self.req_blocks[name] = [[fb.pop(0) for _ in range(MAX_BLOCKS)] for fb in self.free_blocks]

    def _build_attention_metadata(self, reqs, token_reqs, token_pos, num_tokens_padded, num_reqs_padded):
        """Fill the persistent per-group buffers (padded requests: null block, length 1; padded tokens: null slots)."""
        num_tokens = len(token_reqs)
        pad_tokens = num_tokens_padded - num_tokens
        req_idx = torch.tensor(token_reqs + list(range(len(reqs), len(reqs) + pad_tokens)), dtype=torch.int64)
        pos = torch.tensor(token_pos + [0] * pad_tokens, dtype=torch.int64)
        self.token_req_indices[:num_tokens_padded].copy_(req_idx.to(self.device))
        self.positions[:num_tokens_padded].copy_(pos.to(self.device))
        attn_metadata = {}
        for g, layers in enumerate(KV_CACHE_GROUPS):
            buf = self.group_buffers[g]
            table = torch.zeros(num_reqs_padded, MAX_BLOCKS, dtype=torch.int64)
            for i, (name, seq_len) in enumerate(reqs):
                table[i] = torch.tensor(self.req_blocks[name][g])
            seq_lens = torch.tensor([s for _, s in reqs] + [1] * (num_reqs_padded - len(reqs)), dtype=torch.int64)
            slots = [int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for r, p in zip(token_reqs, token_pos)]
            slots += list(range(pad_tokens))                                  # padded tokens: null block slots
            buf["block_table"][:num_reqs_padded].copy_(table.to(self.device))
            buf["seq_lens"][:num_reqs_padded].copy_(seq_lens.to(self.device))
            buf["slot_mapping"][:num_tokens_padded].copy_(torch.tensor(slots, dtype=torch.int64).to(self.device))
            md = AscendMetadata(buf["block_table"][:num_reqs_padded], buf["seq_lens"][:num_reqs_padded],
                                buf["slot_mapping"][:num_tokens_padded], self.token_req_indices[:num_tokens_padded],
                                self.positions[:num_tokens_padded])
            for layer in layers:                                          # filled KV-cache group by group
                attn_metadata[LAYER_NAMES[layer]] = md
        return attn_metadata

    def _update_full_graph_params_if_needed(self, forward_context, num_tokens_padded):
        if forward_context.cudagraph_runtime_mode == "FULL" and not forward_context.capturing:
            update_full_graph_params(self.attn_backend, self.update_stream, forward_context, num_tokens_padded)

    def _model_forward(self, num_tokens_padded, input_ids=None, positions=None):
        forward_context = get_forward_context()
        if self.use_graph and num_tokens_padded in self.model.concrete_aclgraph_entries:
            self._update_full_graph_params_if_needed(forward_context, num_tokens_padded)    # enable_enpu order
        return self.model(input_ids=input_ids, positions=positions)

    def _dummy_run(self, num_tokens, runtime_mode):
        reqs = [(f"dummy{i}", 1) for i in range(num_tokens)]
        self.req_blocks.update({n: [[0] * MAX_BLOCKS, [0] * MAX_BLOCKS] for n, _ in reqs})
        attn_metadata = self._build_attention_metadata(reqs, list(range(num_tokens)), [0] * num_tokens, num_tokens,
                                                       num_tokens)
        self.input_ids[:num_tokens].zero_()
        with set_ascend_forward_context(attn_metadata, num_tokens=num_tokens, num_actual_tokens=num_tokens,
                                        aclgraph_runtime_mode=runtime_mode):
            self._model_forward(num_tokens, self.input_ids[:num_tokens], self.positions[:num_tokens])

    def capture_model(self):
        if not self.use_graph:
            return
        for num_tokens in reversed(self.cudagraph_batch_sizes):
            self._dummy_run(num_tokens, "NONE")                              # cudagraph_num_of_warmups
            self._dummy_run(num_tokens, "FULL")

    def execute_model(self, scheduled):
        reqs, token_reqs, token_pos, token_ids = [], [], [], []
        for i, req in enumerate(scheduled):
            reqs.append((req["name"], req["positions"][-1] + 1))
            token_reqs += [i] * len(req["token_ids"])
            token_pos += req["positions"]
            token_ids += req["token_ids"]
        num_tokens = len(token_ids)
        uniform_decode = all(len(req["token_ids"]) == 1 for req in scheduled)
        if self.use_graph and uniform_decode and num_tokens <= self.cudagraph_batch_sizes[-1]:
            mode, padded = "FULL", next(s for s in self.cudagraph_batch_sizes if s >= num_tokens)
        else:
            mode, padded = "NONE", num_tokens
        attn_metadata = self._build_attention_metadata(reqs, token_reqs, token_pos, padded,
                                                       padded if mode == "FULL" else len(reqs))
        self.input_ids[:num_tokens].copy_(torch.tensor(token_ids, dtype=torch.int64).to(self.device))
        with set_ascend_forward_context(attn_metadata, num_tokens=padded, num_actual_tokens=num_tokens,
                                        aclgraph_runtime_mode=mode):
            hidden_states = self._model_forward(padded, self.input_ids[:padded], self.positions[:padded])
        return self.model.compute_logits(hidden_states[:num_tokens])


# --- workload ------------------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant, _ATTN_KEYS_BUFFER
    _variant = variant

    def serve(use_graphs):
        global _ATTN_KEYS_BUFFER
        _ATTN_KEYS_BUFFER = None
        runner = NPUModelRunner(device, enforce_eager=not use_graphs)
        runner.capture_model()
        prompts = {"A": [3, 5, 7, 2, 9], "B": [4, 11, 6], "C": [8, 1, 13, 10]}
        lengths, last, outs, seen = {}, {}, [], set()

        def prefill(name):
            runner.add_request(name)
            lengths[name] = len(prompts[name])
            return {"name": name, "token_ids": prompts[name], "positions": list(range(lengths[name]))}

        def decode(name):
            lengths[name] += 1
            return {"name": name, "token_ids": [last[name]], "positions": [lengths[name] - 1]}

        schedule = [["A"], ["B"], ["A", "B"], ["C"]] + [["A", "B", "C"]] * 3
        for step in schedule:
            batch = [decode(n) if n in seen else prefill(n) for n in step]
            seen.update(step)
            logits = runner.execute_model(batch)
            outs.append(logits.clone())
            ends = torch.tensor([len(r["token_ids"]) for r in batch]).cumsum(0) - 1
            for req, row in zip(batch, ends.tolist()):
                last[req["name"]] = int(logits[row].argmax())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
