"""Habana vLLM fork, HPU graphs for decode: the runner decides to serve a decode step from a captured graph whenever the
longest context is within ``max_seq_len_to_capture``, but it only captured graphs up to the largest entry of
``_MAX_SEQ_LENS_TO_CAPTURE``; a decode step whose context has grown past that bucket asks for a graph (batch, block
count) that was never captured, and serving stops.

Upstream: https://github.com/HabanaAI/vllm-fork/commit/972acf3ccb086568b76e49ca76fbe884f3f0fb7e ("Fix out-of-bound
HPUGraph capture issue", HabanaAI/vllm-fork, by Konrad Zawora, committed 2024-05-09 on the habana_main line; a direct
commit, no pull request).
Read: the commit's diff of ``vllm/worker/habana_model_runner.py`` (one line added to ``use_captured_graph`` in
``HabanaModelRunner._prepare_decode``: ``and max_seq_len <= _MAX_SEQ_LENS_TO_CAPTURE[-1]``) and, at its parent
84a46987f, the module constants ``_BATCH_SIZES_TO_CAPTURE`` / ``_MAX_SEQ_LENS_TO_CAPTURE`` (1, 32, 64, 128, then 256
steps up to 2048), ``_get_graph_batch_size`` and ``_get_graph_max_seq_len``, ``set_block_size`` /
``get_max_block_per_batch`` (``graph_block_tables`` is ``max batch x max_seq_len_to_capture / block_size``),
``_prepare_decode`` (padding rows: token 0, position 0, ``_PAD_SLOT_ID`` slot, seq_len 1, empty block table; the
graph block table sliced to ``ceil(_get_graph_max_seq_len(max_seq_len) / block_size)`` columns), ``execute_model``
(graph key ``(input_tokens.shape[0], block_tables.shape[1])`` looked up in ``self.graph_runners``), ``capture_model``
(every (batch, max_seq_len) of the two lists, skipping batches above ``max_num_seqs``, contexts above
``max_seq_len_to_capture`` and block counts already captured, dummy inputs shared by all graphs) and
``HPUGraphRunner.capture`` / ``forward`` (one eager run, capture, input buffers = the capture-time tensors, copy-in
then ``graph.replay()``). ``max_seq_len_to_capture`` defaults to ``max_model_len`` (``vllm/config.py``).
Symptom: on Gaudi with HPU graphs, serving crashes as soon as a decode batch's longest sequence passes 2048 tokens while
``max_seq_len_to_capture`` (max_model_len) is larger: ``self.graph_runners[graph_runner_key]`` raises ``KeyError`` for
a block count that no graph was captured for; enforce_eager serves.
Mechanism: capture covers block counts up to ``ceil(2048 / block_size)``; ``_prepare_decode`` keeps
``use_captured_graph`` true up to ``max_seq_len_to_capture`` and pads the context to the next 256 multiple, so the
step's block-table width is one no graph was captured for: the replay is asked to serve more columns (context blocks)
than any captured graph has.
Doctor: undersized-buffer, at _prepare_decode. The step decides to replay a graph although its context needs more
block-table columns than the largest captured graph holds; the fix keeps such steps eager.
Fix (upstream): also require ``max_seq_len <= _MAX_SEQ_LENS_TO_CAPTURE[-1]`` before using a captured graph.
Modelled: the constants and helpers above (scaled down: batch buckets 1, 2, 4 and 8, context buckets 1, 4, 8, 16, 32,
block size 4, max_seq_len_to_capture = max_model_len = 64), ``_prepare_decode`` / ``_prepare_prompt`` (reduced),
``execute_model``, ``capture_model`` and ``HPUGraphRunner`` as read, graphs via the engine. Stand-ins: a 2-layer
decoder (embedding plus learned positions, paged KV writes at ``slot_mapping`` with padded slots sent to reserved block
0, paged decode attention over each row's block table limited by its seq_len, gated MLP), greedy sampling; the prompt
runs as one row per token (causal via per-row seq_lens) instead of the padded 2-D prompt batch; float64.
Workload: max_num_seqs 4. Prefill A (26 tokens) and B (18) eagerly; four decode steps of [A, B] (graph batch 2, 8
blocks), then six of [A] alone (graph batch 1) while A's context grows from 31 to 36 tokens. Bug: the third [A] step
(context 33, padded to 64 = 16 blocks) raises ``KeyError: (1, 16)`` in ``execute_model``. Fix: steps with a context
above 32 run eagerly; the logits of all eleven steps equal eager (max error 0).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HabanaAI/vllm-fork/commit/972acf3ccb086568b76e49ca76fbe884f3f0fb7e"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "_prepare_decode"
SYMPTOM = ("HPU-graph decode crashes with a KeyError once a sequence's context passes the largest captured context "
           "bucket while max_seq_len_to_capture is larger: the step asks for a graph block count never captured")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS = 32, 16, 2, 8, 24, 2
NUM_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS = 40, 64, 4
DTYPE = torch.float64

_PAD_SLOT_ID = -1
_BATCH_SIZE_ALIGNMENT = 8            # upstream 16
# Capture graphs for token size 1, 2, 4, 8 (upstream: 1, 2, 4, 8, 16, 32, 48, ..., 512).
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + [_BATCH_SIZE_ALIGNMENT * i for i in range(1, 2)]
# Capture graphs for context 1, 4, 8, 16, 32 (upstream: 1, 32, 64, 128, 256, 512, 768 ... 2048).
_MAX_SEQ_LEN_ALIGNMENT = 32          # upstream 256
_MAX_SEQ_LENS_TO_CAPTURE = [1, 4, 8, 16] + [_MAX_SEQ_LEN_ALIGNMENT * i for i in range(1, 2)]

_variant = "bug"


def _get_graph_batch_size(batch_size: int) -> int:
    if batch_size <= 2:
        return batch_size
    elif batch_size <= 4:
        return 4
    elif batch_size <= 8:
        return 8
    else:
        return (batch_size + _BATCH_SIZE_ALIGNMENT - 1) // _BATCH_SIZE_ALIGNMENT * _BATCH_SIZE_ALIGNMENT


def _get_graph_max_seq_len(max_seq_len: int) -> int:
    if max_seq_len <= 4:
        return 4
    elif max_seq_len <= 8:
        return 8
    elif max_seq_len <= 16:
        return 16
    else:
        return (max_seq_len + _MAX_SEQ_LEN_ALIGNMENT - 1) // _MAX_SEQ_LEN_ALIGNMENT * _MAX_SEQ_LEN_ALIGNMENT


@dataclasses.dataclass
class AttentionMetadata:
    is_prompt: bool
    slot_mapping: torch.Tensor
    seq_lens_tensor: torch.Tensor
    block_tables: torch.Tensor
    max_seq_len: int
    use_cuda_graph: bool


# --- the model (stand-in for the Llama decoder on HPU) ------------------------------------------------------------------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size):
    """Each query row attends over its block table's slots, up to its seq_len."""
    width = block_tables.size(1)
    ctx = torch.arange(width * block_size, device=q.device)
    slots = block_tables[:, ctx // block_size].long() * block_size + ctx % block_size
    k, v = k_cache.view(-1, N_HEADS, HEAD_DIM)[slots], v_cache.view(-1, N_HEADS, HEAD_DIM)[slots]
    scores = torch.einsum("thd,tchd->thc", q, k) / HEAD_DIM ** 0.5
    masked = ctx[None, :] >= seq_lens[:, None]
    return torch.einsum("thc,tchd->thd", scores.masked_fill(masked[:, None, :], float("-inf")).softmax(-1), v)


class DecoderLayer:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o = r(3 * HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)

    def forward(self, h, kv_cache, md: AttentionMetadata, block_size):
        q, k, v = F.linear(rms_norm(h, self.in_norm), self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        k_cache, v_cache = kv_cache
        slots = md.slot_mapping.view(-1)
        slots = torch.where(slots < 0, torch.zeros_like(slots), slots)       # padded rows: reserved block 0
        k_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, slots, k)
        v_cache.view(-1, N_HEADS, HEAD_DIM).index_copy_(0, slots, v)
        attn = paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens_tensor, block_size)
        h = h + F.linear(attn.reshape(-1, HIDDEN), self.o)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class LlamaForCausalLM:
    def __init__(self, device, block_size):
        gen = generator(972)
        self.block_size = block_size
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(MAX_MODEL_LEN, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [DecoderLayer(gen, device) for _ in range(N_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)

    def __call__(self, input_ids, positions, kv_caches, attn_metadata):
        h = self.embed_tokens[input_ids.view(-1)] + self.embed_positions[positions.view(-1)]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer.forward(h, kv_cache, attn_metadata, self.block_size)
        return rms_norm(h, self.norm)

    def compute_logits(self, hidden_states):
        return F.linear(hidden_states, self.lm_head)


# --- vllm/worker/habana_model_runner.py (reduced) -----------------------------------------------------------------------

class HPUGraphRunner:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.graph = None
        self.input_buffers: dict[str, torch.Tensor] = {}
        self.output_buffers: dict[str, torch.Tensor] = {}

    def capture(self, input_ids, positions, kv_caches, attn_metadata, name):
        assert self.graph is None
        self.input_buffers = {
            "input_ids": input_ids, "positions": positions, "slot_mapping": attn_metadata.slot_mapping,
            "seq_lens_tensor": attn_metadata.seq_lens_tensor, "block_tables": attn_metadata.block_tables,
        }
        state = {f"kv_caches[{i}].{n}": t for i, c in enumerate(kv_caches) for n, t in zip("kv", c)}
        # Run the model once without capturing the graph, then capture it.
        self.graph, hidden_states = capture(
            lambda: self.model(input_ids, positions, kv_caches, attn_metadata), device=self.device, warmups=1,
            static=self.input_buffers, state=state, owner="HabanaModelRunner", name=name)
        self.output_buffers = {"hidden_states": hidden_states}

    def forward(self, input_ids, positions, kv_caches, attn_metadata, real_batch_size=None):
        del kv_caches                                  # KV caches are fixed tensors
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["positions"].copy_(positions)
        self.input_buffers["slot_mapping"].copy_(attn_metadata.slot_mapping)
        self.input_buffers["seq_lens_tensor"].copy_(attn_metadata.seq_lens_tensor)
        self.input_buffers["block_tables"].copy_(attn_metadata.block_tables)
        out = self.output_buffers["hidden_states"]
        return replay(self.graph, out, real=real_batch_size, size=out.shape[0],
                      padded={"block_tables": self.input_buffers["block_tables"]})

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


@dataclasses.dataclass
class Sequence:
    token_ids: list
    blocks: list
    prompt_len: int

    def get_len(self):
        return len(self.token_ids)

    def block_table(self, block_size):
        return self.blocks[:math.ceil(self.get_len() / block_size)]


class HabanaModelRunner:
    def __init__(self, device, enforce_eager, block_size=4):
        self.device, self.enforce_eager = device, enforce_eager
        self.max_seq_len_to_capture = MAX_MODEL_LEN                 # defaults to max_model_len
        self.graph_runners: dict[tuple[int, int], HPUGraphRunner] = {}
        self.set_block_size(block_size)
        self.model = LlamaForCausalLM(device, block_size)

    def set_block_size(self, block_size):
        self.block_size = block_size
        self.graph_block_tables = np.zeros((max(_BATCH_SIZES_TO_CAPTURE), self.get_max_block_per_batch()),
                                           dtype=np.int32)

    def get_max_block_per_batch(self):
        return (self.max_seq_len_to_capture + self.block_size - 1) // self.block_size

    def _prepare_prompt(self, seqs):
        tokens, positions, slots, seq_lens, tables = [], [], [], [], []
        for seq in seqs:
            table = seq.block_table(self.block_size)
            for pos in range(seq.get_len()):
                tokens.append([seq.token_ids[pos]])
                positions.append([pos])
                slots.append([table[pos // self.block_size] * self.block_size + pos % self.block_size])
                seq_lens.append(pos + 1)                              # causal, one row per prompt token
                tables.append(table + [0] * (self.get_max_block_per_batch() - len(table)))
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
        md = AttentionMetadata(True, t(slots, torch.long), t(seq_lens, torch.int), t(tables, torch.int),
                               max(seq_lens), False)
        return t(tokens, torch.long), t(positions, torch.long), md

    def _prepare_decode(self, seqs):
        input_tokens, input_positions, slot_mapping, seq_lens, block_tables = [], [], [], [], []
        for seq in seqs:
            input_tokens.append([seq.token_ids[-1]])
            seq_len = seq.get_len()
            position = seq_len - 1
            input_positions.append([position])
            seq_lens.append(seq_len)
            block_table = seq.block_table(self.block_size)
            slot_mapping.append([block_table[position // self.block_size] * self.block_size
                                 + position % self.block_size])
            block_tables.append(block_table)

        batch_size = len(input_tokens)
        max_seq_len = max(seq_lens)
        use_captured_graph = (not self.enforce_eager and batch_size <= _BATCH_SIZES_TO_CAPTURE[-1]
                              and max_seq_len <= self.max_seq_len_to_capture)
        if _variant == "fix":
            use_captured_graph = use_captured_graph and max_seq_len <= _MAX_SEQ_LENS_TO_CAPTURE[-1]
        if use_captured_graph:
            graph_batch_size = _get_graph_batch_size(batch_size)
            assert graph_batch_size >= batch_size
            for _ in range(graph_batch_size - batch_size):
                input_tokens.append([0])
                input_positions.append([0])
                slot_mapping.append([_PAD_SLOT_ID])
                seq_lens.append(1)
                block_tables.append([])
            batch_size = graph_batch_size

        t = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
        if use_captured_graph:
            # The shape of graph_block_tables is [max batch size, max context len // block size].
            graph_max_seq_len = _get_graph_max_seq_len(max_seq_len)
            assert graph_max_seq_len >= max_seq_len
            graph_block_count = math.ceil(graph_max_seq_len / self.block_size)
            input_block_tables = self.graph_block_tables[:batch_size, :graph_block_count]
            for i, block_table in enumerate(block_tables):
                if block_table:
                    input_block_tables[i, :len(block_table)] = block_table
            block_tables = torch.tensor(input_block_tables, device=self.device)
        else:
            width = max(len(b) for b in block_tables)                    # make_tensor_with_pad
            block_tables = t([b + [0] * (width - len(b)) for b in block_tables], torch.int)
        md = AttentionMetadata(False, t(slot_mapping, torch.long), t(seq_lens, torch.int), block_tables,
                               max_seq_len, use_captured_graph)
        return t(input_tokens, torch.long), t(input_positions, torch.long), md

    def execute_model(self, seqs, kv_caches, is_prompt):
        prepare = self._prepare_prompt if is_prompt else self._prepare_decode
        input_tokens, input_positions, attn_metadata = prepare(seqs)
        if not attn_metadata.is_prompt and attn_metadata.use_cuda_graph:
            graph_batch_size = input_tokens.shape[0]
            graph_block_count = attn_metadata.block_tables.shape[1]
            graph_runner_key = (graph_batch_size, graph_block_count)
            model_executable = self.graph_runners[graph_runner_key]
            hidden_states = model_executable(input_tokens, input_positions, kv_caches, attn_metadata,
                                             real_batch_size=len(seqs))
        else:
            hidden_states = self.model(input_tokens, input_positions, kv_caches, attn_metadata)
        if is_prompt:                                              # selected_token_indices: last prompt token
            last = torch.tensor(np.cumsum([s.get_len() for s in seqs]) - 1, device=self.device)
            hidden_states = hidden_states.index_select(0, last)
        logits = self.model.compute_logits(hidden_states[:len(seqs)]).clone()
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):     # greedy sampler
            seq.token_ids.append(token)
        return logits

    def capture_model(self, kv_caches):
        max_batch_size = max(_BATCH_SIZES_TO_CAPTURE)
        input_tokens = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        input_positions = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        slot_mapping = torch.full((max_batch_size, 1), _PAD_SLOT_ID, dtype=torch.long, device=self.device)
        context_lens = torch.ones(max_batch_size, dtype=torch.int32, device=self.device)
        block_tables = torch.from_numpy(self.graph_block_tables).to(self.device).clone()   # a device copy
        valid_combinations = []
        for batch_size, max_seq_len in ((b, c) for b in reversed(_BATCH_SIZES_TO_CAPTURE)
                                        for c in reversed(_MAX_SEQ_LENS_TO_CAPTURE)):
            if batch_size > MAX_NUM_SEQS:                          # batch out of bound
                continue
            if max_seq_len > self.max_seq_len_to_capture:          # context out of bound
                continue
            block_count = math.ceil(max_seq_len / self.block_size)
            if block_count in [math.ceil(cl / self.block_size) for (n, cl) in valid_combinations if n == batch_size]:
                continue                                           # block count already captured
            valid_combinations.append((batch_size, max_seq_len))
        for batch_size, max_seq_len in valid_combinations:
            block_count = math.ceil(max_seq_len / self.block_size)
            attn_metadata = AttentionMetadata(False, slot_mapping[:batch_size], context_lens[:batch_size],
                                              block_tables[:batch_size, :block_count],
                                              block_count * self.block_size, True)
            graph_runner = HPUGraphRunner(self.model, self.device)
            graph_runner.capture(input_tokens[:batch_size], input_positions[:batch_size], kv_caches, attn_metadata,
                                 name=f"HPUGraph batch {batch_size} block_count {block_count}")
            self.graph_runners[(batch_size, block_count)] = graph_runner


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(enforce_eager: bool):
        runner = HabanaModelRunner(device, enforce_eager)
        kv_caches = [tuple(torch.zeros(NUM_BLOCKS, runner.block_size, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                           for _ in range(2)) for _ in range(N_LAYERS)]
        if not enforce_eager:
            runner.capture_model(kv_caches)
        gen = generator(9720)
        seqs = {name: Sequence(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), blocks, n)
                for name, n, blocks in (("A", 26, list(range(1, 17))), ("B", 18, list(range(17, 33))))}
        outs = [runner.execute_model([seqs["A"], seqs["B"]], kv_caches, is_prompt=True)]
        for batch in [["A", "B"]] * 4 + [["A"]] * 6:               # B finishes after four decode steps
            outs.append(runner.execute_model([seqs[n] for n in batch], kv_caches, is_prompt=False))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
