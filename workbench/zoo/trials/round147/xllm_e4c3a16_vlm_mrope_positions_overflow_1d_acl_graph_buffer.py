"""xLLM serves vision-language models (Qwen2.5-VL, GLM-4V) whose language model takes multimodal rotary positions
(mRoPE): the batch builder hands every forward a ``[3, num_tokens]`` position tensor (temporal, height and width
rows; for decode ``get_positions_d`` expands one position to three rows). With ``--enable_graph`` on an Ascend NPU the
executor factory gives every backend, the ``vlm`` one included, the ``AclGraphExecutorImpl``, which runs prefill
eagerly and captures decode steps lazily per token bucket into NPU graphs (aclgraph, torch_npu's ``NPUGraph``). Its
``GraphPersistentParam`` owns the static input buffers the graphs read, and allocated ``persistent_positions_`` as
``[max_tokens_per_batch]``, one row, as for a text model. ``update``, which copies each decode step's inputs into
those buffers before the capture and before every replay, sliced dim 0 and copied the ``[3, n]`` positions into a
``[n]`` view: the copy cannot broadcast, so the first decode step of every VLM request crashed the worker
("Shape of broadcast result should be [3,1], but self is [1]"), while the same server without graphs decodes. The fix
allocates ``[3, max_tokens_per_batch]`` for mRoPE models and slices dim 1 in ``update`` and in the accessor the
capture reads.

Upstream: https://github.com/xLLM-AI/xllm/commit/e4c3a163a33d5e34b53d821c7bbdb59cd52de42f, the squash-merge of pull
request #802 ("bugfix: allow non-text content in chat JSON for VLM backends.", repository xLLM-AI/xllm, author
QwertyJack, opened 2026-01-26, committed 2026-02-11). Its description says that while testing it the author
"discovered #884 (mRoPE position tensor shape mismatch in NPU graph mode), fixed in #885"; the merged commit carries
that fix in ``xllm/core/runtime/acl_graph_executor_impl.cpp/.h`` (#885 itself is open in the store, "Fixes #884").
Read, in a mirror of the repository: the whole diff of e4c3a163a for ``acl_graph_executor_impl.cpp`` and ``.h``
(``use_mrope_``, the ``[3, max_tokens_per_batch]`` allocation, the dim-1 copy in ``update``, the dim-1 slice in
``persistent_positions``) and its file list; at its parent: all of ``acl_graph_executor_impl.cpp``'s
``GraphPersistentParam`` constructor, ``update`` (with ``return_capture_params``), ``AclGraph::capture`` (update,
capture on a side stream, ``set_hidden_states``, a test ``replay``), ``AclGraph::replay``, ``AclGraphExecutorImpl::run``
(eager for prefill, lazy capture per bucket) and ``get_bucket_num_tokens``; the header's accessors; ``executor.cpp``
and ``ExecutorImplFactory::create_executor_impl`` (``FLAGS_enable_graph`` turns the backend into the device type,
``REGISTER_EXECUTOR("npu", AclGraphExecutorImpl)``, ``REGISTER_EXECUTOR("vlm", VlmExecutorImpl)``);
``VlmExecutorImpl::process_mm_data``/``run``; ``vlm_worker_impl.cpp``'s forward call; ``BatchInputBuilder``'s mRoPE
positions (``mrope_positions_vec``, ``torch::cat(..., 1)``); ``MPositionHelper::get_positions`` and
``get_positions_d``; the NPU ``LlmModelImplBase::forward`` (``input_embedding`` or ``npu_embed_tokens_``, the
``cos_sin_`` lookup and the mRoPE section ``apply``); ``Qwen2_5_VLForConditionalGeneration``'s ``forward`` (its
language model). Also issue #884 (the error and root cause), #885's description and one review thread, and the later
commit b17790015 (#908, "support graph mode for LLM part of VLM model on NPU device").
Not read: the API-service half of #802's diff (chat JSON, not graphs), the NPU decoder layer and ATB paged attention,
``plan_paged_attention_tiling``, ``update_attention_mask``, torch_npu's ``NPUGraph``, ``get_positions_p``'s image and
video branches beyond their result, ``ModelInputParams`` in full, the sampler, and any test of the fix (the diff has
none).
Symptom: issue #884: "VLM models (e.g., qwen2.5-vl, glm4v) crash during the decode phase when running on NPU with Graph
Mode enabled": ``call aclnnInplaceCopy failed ... EZ1001: Shape of broadcast result should be [3,1], but self is [1].``
Mechanism: the first decode step of a bucket reaches ``AclGraph::capture``, which calls ``update`` before capturing;
replays call it too. ``update`` runs ``persistent_positions_.slice(0, 0, n).copy_(positions)`` with ``positions`` of
shape ``[3, n]`` and a destination of shape ``[n]``, which torch (like aclnn) refuses: the static buffer has no room
for the rows mRoPE adds. Without graphs (``VlmExecutorImpl``) the forward takes the step's own ``[3, n]`` positions.
Doctor: undersized-buffer, at ``update``: the step's data (three position rows per token) do not fit the static buffer
the graphs read; ``update`` is where each step is written into it, with the slice that cannot hold it, and is changed by
the fix (with the allocation in the ``GraphPersistentParam`` constructor and the ``persistent_positions`` accessor).
Fix (upstream): ``use_mrope_ = !args.rope_scaling_mrope_section().empty()``; for mRoPE models
``persistent_positions_ = zeros({3, max_tokens_per_batch})``; ``update`` copies into ``slice(1, 0, n)``;
``persistent_positions(n)`` returns ``slice(1, 0, n)`` (dim 0 otherwise).
Modelled: ``ModelArgs`` (``rope_scaling_mrope_section``), ``Sequence``, ``MPositionHelper`` (``get_positions``,
``get_positions_p``, ``get_positions_d``), ``BatchInputBuilder`` (``build_forward_input``), ``ForwardInput``,
``ModelInputParams``, ``LlmModelImplBase.forward`` and ``Qwen2_5_VLForConditionalGeneration`` (``get_input_embeddings``,
``forward``, ``logits``), ``GraphPersistentParam`` (constructor, ``update``, ``persistent_positions`` and the other
accessors, ``set_hidden_states``), ``AclGraph`` (``capture``, ``replay``), ``AclGraphExecutorImpl`` (``run``,
``get_bucket_num_tokens``), ``VlmExecutorImpl`` (``process_mm_data``, ``run``), ``ExecutorImplFactory``
(``create_executor_impl``), ``VLMWorkerImpl.step``.
Stand-ins: the NPU graph is the workbench's graph (CUDA graph on a GPU, its emulation on the CPU); no side stream,
capture lock, tiling plan or attention mask. The model is mine: 2 layers of width 16, 2 heads of 8 with
``mrope_section`` [1, 1, 2], SiLU MLP of 32, vocabulary 24, RMSNorm, rotate-half RoPE from a ``cos_sin_`` table
(upstream: an ATB gather and interleaved pairs), paged K/V with block size 4; float64; greedy sampling. Prefill
attention loops over sequences on the host (it is never captured). Requests are text-only: at this revision the NPU
graph executor did not run the vision encoder (``process_mm_data`` is ``VlmExecutorImpl``'s; the MLU graph executor
called it, the ACL one did not; #908 later wrapped the graph executor in the VLM one), so an image request would differ
from the run without graphs for a reason this fix does not touch.
Decode batches are exactly a bucket's size, so no padded rows are involved.
Workload: requests A (prompt of 6, 4 new tokens) and B (prompt of 4, 7 new tokens), prefilled together; three decode
steps of both (bucket 2: capture and test replay, then two replays), then three of B alone (bucket 1). Outputs: the
logits of each step, the sampled tokens, and every layer's K and V caches at the end.
Measured: the check printed
  xllm_e4c3a16_vlm_mrope_positions_overflow_1d_acl_graph_buffer [bug] on cpu: misbehaves (raised RuntimeError:
      output with shape [2] doesn't match the broadcast shape [3, 2])
  xllm_e4c3a16_vlm_mrope_positions_overflow_1d_acl_graph_buffer [fix] on cpu: equals eager (max |graph - eager| = 0)
The bug raises at the first decode step (bucket 2), in ``update`` before the capture, as upstream's aclnn copy did. The
fix captures the bucket-2 graph at the first decode step and the bucket-1 graph once A is done, replays each twice, and
every step's logits, tokens (A: 23, 14, 21, 23; B: 20, 23, 19, 6, 20, 20, 23) and caches equal the run without graphs.
(As a check of the workload, not part of the program: leaving the positions buffer unwritten on replays makes the fix
differ by up to 12 in the logits, so the replays do read the positions.) Both variants, each with its run without
graphs, took about 3 s on the CPU.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/xLLM-AI/xllm/commit/e4c3a163a33d5e34b53d821c7bbdb59cd52de42f"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "update"
SYMPTOM = ("with NPU graph mode, a VLM's first decode step crashed: GraphPersistentParam kept one row of positions per "
           "token, and update copied the step's [3, n] mRoPE positions into it")

DTYPE = torch.float64
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, INTERMEDIATE, NUM_LAYERS = 24, 16, 2, 8, 32, 2
MROPE_SECTION = [1, 1, 2]                          # sums to HEAD_DIM / 2
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_SEQ = 4, 9, 4   # block 0 is never handed out
MAX_TOKENS_PER_BATCH, MAX_SEQS_PER_BATCH, MAX_POSITION = 8, 4, 32
_variant = "bug"


@dataclasses.dataclass
class ModelArgs:
    rope_scaling_mrope_section: list = dataclasses.field(default_factory=lambda: list(MROPE_SECTION))
    rope_scaling_rope_type: str = "mrope"
    max_position_embeddings: int = MAX_POSITION


# --- framework/batch ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sequence:
    tokens: list
    num_prompt_tokens: int
    blocks: list
    max_tokens: int
    kv_cache_tokens_num: int = 0
    mrope_position_delta: int = 0

    def num_tokens(self) -> int:
        return len(self.tokens)

    def finished(self) -> bool:
        return len(self.tokens) - self.num_prompt_tokens >= self.max_tokens


class MPositionHelper:
    def __init__(self, seq: Sequence, args: ModelArgs):
        self.seq_, self.args_ = seq, args

    def get_positions(self) -> Tensor:
        if self.seq_.kv_cache_tokens_num < self.seq_.num_prompt_tokens:
            positions, delta = self.get_positions_p()
            self.seq_.mrope_position_delta = delta
            return positions
        return self.get_positions_d()

    def get_positions_p(self):
        """Prompt positions: a text run gives ``arange(len).expand(3, -1)``; image and video grids (none here) give
        their (t, h, w) rows. ``mrope_position_delta = max + 1 - len``."""
        n = self.seq_.num_prompt_tokens
        llm_positions = torch.arange(n, dtype=torch.int32).view(1, -1).expand(3, -1)
        return llm_positions, int(llm_positions.max()) + 1 - n

    def get_positions_d(self) -> Tensor:
        n = self.seq_.num_tokens()
        return torch.arange(self.seq_.mrope_position_delta + n - 1, self.seq_.mrope_position_delta + n,
                            dtype=torch.int32).expand(3, -1)


@dataclasses.dataclass
class ModelInputParams:
    is_decode: bool
    num_sequences: int
    q_seq_lens: Tensor
    kv_seq_lens: Tensor
    q_seq_lens_vec: list
    kv_seq_lens_vec: list
    new_cache_slots: Tensor
    block_tables: Tensor
    input_embedding: Tensor | None = None

    def to(self, device) -> ModelInputParams:
        return dataclasses.replace(self, q_seq_lens=self.q_seq_lens.to(device), kv_seq_lens=self.kv_seq_lens.to(device),
                                   new_cache_slots=self.new_cache_slots.to(device),
                                   block_tables=self.block_tables.to(device))


@dataclasses.dataclass
class ForwardInput:
    token_ids: Tensor
    positions: Tensor
    input_params: ModelInputParams
    selected_token_idxes: Tensor


class BatchInputBuilder:
    def __init__(self, args: ModelArgs):
        self.args_ = args
        self.use_mrope_ = args.rope_scaling_rope_type == "mrope"

    def build_forward_input(self, sequences: list, device) -> ForwardInput:
        tokens, mrope_positions_vec, slots, q_lens, kv_lens, tables = [], [], [], [], [], []
        is_decode = all(s.kv_cache_tokens_num >= s.num_prompt_tokens for s in sequences)
        for seq in sequences:
            n_kv, seq_len = seq.kv_cache_tokens_num, seq.num_tokens()
            mrope_positions_vec.append(MPositionHelper(seq, self.args_).get_positions())
            for j in range(n_kv, seq_len):
                tokens.append(seq.tokens[j])
                slots.append(seq.blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE)
            q_lens.append(seq_len - n_kv)
            kv_lens.append(seq_len)
            tables.append(seq.blocks + [0] * (MAX_BLOCKS_PER_SEQ - len(seq.blocks)))
        positions = torch.cat(mrope_positions_vec, 1)                     # [3, num_tokens]
        params = ModelInputParams(is_decode, len(sequences), torch.tensor(q_lens, dtype=torch.int32),
                                  torch.tensor(kv_lens, dtype=torch.int32), q_lens, kv_lens,
                                  torch.tensor(slots, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32))
        selected = torch.tensor(q_lens).cumsum(0) - 1                     # each sequence's last token
        return ForwardInput(torch.tensor(tokens, dtype=torch.int32).to(device), positions.to(device),
                            params.to(device), selected.to(device))


# --- model ----------------------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


class LlmModelImplBase:
    """The NPU language model of Qwen2.5-VL (``Qwen2Model``): ``forward`` as ``LlmModelImplBase::forward``."""

    def __init__(self, args: ModelArgs, device):
        gen = generator(802)

        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.mrope_section_ = args.rope_scaling_mrope_section
        self.embed_tokens = w(VOCAB, HIDDEN, scale=1.0)
        self.layers = [dict(attn_norm=w(HIDDEN, scale=0.1) + 1, wq=w(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5),
                            wk=w(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5), wv=w(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5),
                            wo=w(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5), mlp_norm=w(HIDDEN, scale=0.1) + 1,
                            gate=w(HIDDEN, INTERMEDIATE, scale=HIDDEN ** -0.5),
                            up=w(HIDDEN, INTERMEDIATE, scale=HIDDEN ** -0.5),
                            down=w(INTERMEDIATE, HIDDEN, scale=INTERMEDIATE ** -0.5)) for _ in range(NUM_LAYERS)]
        self.norm = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM))
        emb = torch.arange(MAX_POSITION, dtype=DTYPE)[:, None] * inv_freq[None, :]
        emb = torch.cat([emb, emb], -1)
        self.cos_sin_ = torch.cat([emb.cos(), emb.sin()], -1).to(device)      # [max_position, 2 * head_dim]
        self.ctx_ = torch.arange(MAX_BLOCKS_PER_SEQ * BLOCK_SIZE, device=device)

    def get_input_embeddings(self, tokens: Tensor) -> Tensor:
        return self.embed_tokens[tokens.long()]

    def _mrope(self, x: Tensor, positions: Tensor) -> Tensor:
        """``apply``: section i of the (doubled) rotary dims takes row i % 3 (t, h, w) of the positions."""
        sections = self.mrope_section_ + self.mrope_section_
        x = x.reshape(positions.shape[0], -1, x.shape[-1])
        return torch.cat([m[i % len(self.mrope_section_)] for i, m in enumerate(x.split(sections, -1))], -1)

    def _attention(self, q, kv_cache, params: ModelInputParams):
        k_cache, v_cache = kv_cache
        if params.is_decode:                           # one query per sequence: paged attention over its blocks
            tables, lens = params.block_tables.long(), params.kv_seq_lens.long()
            valid = self.ctx_[None, :] < lens[:, None]
        else:                                          # prefill (never captured): causal within each sequence
            rows, limits = [], []
            for s, (q_len, kv_len) in enumerate(zip(params.q_seq_lens_vec, params.kv_seq_lens_vec)):
                rows += [s] * q_len
                limits += range(kv_len - q_len + 1, kv_len + 1)
            tables = params.block_tables.long()[torch.tensor(rows, device=q.device)]
            valid = self.ctx_[None, :] < torch.tensor(limits, device=q.device)[:, None]
        ctx_slots = tables[:, self.ctx_ // BLOCK_SIZE] * BLOCK_SIZE + self.ctx_ % BLOCK_SIZE   # [T, ctx]
        keys, values = k_cache[ctx_slots], v_cache[ctx_slots]                                  # [T, ctx, H, D]
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        return torch.einsum("thc,tchd->thd", torch.softmax(scores, -1), values)

    def forward(self, tokens: Tensor, positions: Tensor, kv_caches: list, input_params: ModelInputParams) -> Tensor:
        h = input_params.input_embedding if input_params.input_embedding is not None else \
            self.get_input_embeddings(tokens)
        cos_pos, sin_pos = self.cos_sin_[positions.reshape(-1).long()].chunk(2, -1)
        if positions.dim() == 2:                       # mrope
            cos_pos, sin_pos = self._mrope(cos_pos, positions), self._mrope(sin_pos, positions)
        cos_pos, sin_pos = cos_pos[:, None, :], sin_pos[:, None, :]
        slots = input_params.new_cache_slots.long()
        n = h.shape[0]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = rms_norm(h, layer["attn_norm"])
            q, k, v = ((x @ layer[name]).view(n, NUM_HEADS, HEAD_DIM) for name in ("wq", "wk", "wv"))
            q, k = q * cos_pos + rotate_half(q) * sin_pos, k * cos_pos + rotate_half(k) * sin_pos
            kv_cache[0].index_copy_(0, slots, k)
            kv_cache[1].index_copy_(0, slots, v)
            h = h + self._attention(q, kv_cache, input_params).reshape(n, HIDDEN) @ layer["wo"]
            x = rms_norm(h, layer["mlp_norm"])
            h = h + (torch.nn.functional.silu(x @ layer["gate"]) * (x @ layer["up"])) @ layer["down"]
        return rms_norm(h, self.norm)


class Qwen2_5_VLForConditionalGeneration:
    def __init__(self, args: ModelArgs, device):
        self.language_model_ = LlmModelImplBase(args, device)
        self.lm_head = (torch.randn(HIDDEN, VOCAB, generator=generator(884), dtype=DTYPE) * 1.5).to(device)

    def get_input_embeddings(self, tokens: Tensor, params: ModelInputParams) -> Tensor:
        return self.language_model_.get_input_embeddings(tokens)      # no image or video embedding to merge

    def forward(self, tokens, positions, kv_caches, input_params) -> Tensor:
        return self.language_model_.forward(tokens, positions, kv_caches, input_params)

    def logits(self, hidden_states: Tensor, selected_idxes: Tensor) -> Tensor:
        return hidden_states[selected_idxes] @ self.lm_head


# --- runtime: executors ---------------------------------------------------------------------------------------------

class VlmExecutorImpl:
    """The ``vlm`` backend without graphs."""

    def __init__(self, model, args, device):
        self.model_, self.device_ = model, device

    def process_mm_data(self, params: ModelInputParams, tokens: Tensor) -> None:
        # (encoder input gather, encode, scatter: no multimodal data in these requests)
        params.input_embedding = self.model_.get_input_embeddings(tokens, params)

    def run(self, tokens, positions, kv_caches, params) -> Tensor:
        self.process_mm_data(params, tokens)
        return self.model_.forward(tokens, positions, kv_caches, params)


class GraphPersistentParam:
    def __init__(self, args: ModelArgs, device):
        self.use_mrope_ = False
        n, b = MAX_TOKENS_PER_BATCH, MAX_SEQS_PER_BATCH

        def z(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.persistent_tokens_ = z(n)
        if _variant == "fix" and args.rope_scaling_mrope_section:
            self.use_mrope_ = True                     # mRoPE positions have shape [3, num_tokens]
            self.persistent_positions_ = z(3, n)
        else:
            self.persistent_positions_ = z(n)
        self.persistent_new_cache_slots_ = z(n)
        self.q_seq_lens_, self.kv_seq_lens_ = z(b), z(b)
        self.persistent_block_tables_ = z(b, MAX_BLOCKS_PER_SEQ)
        self.hidden_states_ = z(n, HIDDEN, dtype=DTYPE)

    def buffers(self) -> dict:
        return {"persistent_tokens_": self.persistent_tokens_, "persistent_positions_": self.persistent_positions_,
                "persistent_new_cache_slots_": self.persistent_new_cache_slots_, "q_seq_lens_": self.q_seq_lens_,
                "kv_seq_lens_": self.kv_seq_lens_, "persistent_block_tables_": self.persistent_block_tables_}

    def persistent_positions(self, actual_tokens: int) -> Tensor:
        return self.persistent_positions_[:, :actual_tokens] if self.use_mrope_ else \
            self.persistent_positions_[:actual_tokens]

    def set_hidden_states(self, value: Tensor) -> None:
        self.hidden_states_[:value.shape[0]].copy_(value)

    def update(self, tokens, positions, params: ModelInputParams, padded_num_tokens: int,
               return_capture_params: bool = False):
        """Copy the step's inputs into the persistent buffers (before the capture and before every replay)."""
        n, b = tokens.shape[0], params.num_sequences
        self.persistent_tokens_[:n].copy_(tokens)
        if self.use_mrope_:                            # (the fix) slice on dim 1
            self.persistent_positions_[:, :n].copy_(positions)
        else:
            self.persistent_positions_[:n].copy_(positions)
        self.q_seq_lens_[:b].copy_(params.q_seq_lens)
        self.kv_seq_lens_[:b].copy_(params.kv_seq_lens)
        self.persistent_new_cache_slots_[:n].copy_(params.new_cache_slots)
        self.persistent_block_tables_[:b, :params.block_tables.shape[1]].copy_(params.block_tables)
        if not return_capture_params:
            return None
        return dataclasses.replace(                    # the capture's params: every tensor a persistent buffer
            params, is_decode=True, num_sequences=padded_num_tokens, input_embedding=None,
            q_seq_lens=self.q_seq_lens_[:padded_num_tokens], kv_seq_lens=self.kv_seq_lens_[:padded_num_tokens],
            q_seq_lens_vec=[1] * padded_num_tokens, kv_seq_lens_vec=list(params.kv_seq_lens_vec),
            new_cache_slots=self.persistent_new_cache_slots_[:padded_num_tokens],
            block_tables=self.persistent_block_tables_[:padded_num_tokens])


class AclGraph:
    def __init__(self, persistent_param: GraphPersistentParam, device):
        self.persistent_param_, self.device = persistent_param, device
        self.graph_, self.outputs_, self.num_tokens_ = None, None, 0

    def capture(self, model, tokens, positions, params, kv_caches, bucket_num_tokens: int) -> Tensor:
        self.num_tokens_ = bucket_num_tokens
        p = self.persistent_param_
        graph_params = p.update(tokens, positions, params, self.num_tokens_, return_capture_params=True)

        def forward():
            hidden = model.forward(p.persistent_tokens_[:self.num_tokens_], p.persistent_positions(self.num_tokens_),
                                   kv_caches, graph_params)
            p.set_hidden_states(hidden)
            return p.hidden_states_[:self.num_tokens_]
        self.graph_, self.outputs_ = capture(
            forward, device=self.device, warmups=0, name=f"xllm decode bucket {bucket_num_tokens}",
            static=p.buffers(), state={f"kv_cache[{i}].{kv}": c[j] for i, c in enumerate(kv_caches)
                                       for j, kv in enumerate(("k", "v"))},
            owner="xllm AclGraphExecutorImpl (GraphPersistentParam)")
        return replay(self.graph_, self.outputs_)[:tokens.shape[0]]     # the test replay: this step's output

    def replay(self, tokens, positions, params) -> Tensor:
        self.persistent_param_.update(tokens, positions, params, self.num_tokens_)
        return replay(self.graph_, self.outputs_, real=tokens.shape[0], size=self.num_tokens_)[:tokens.shape[0]]


class AclGraphExecutorImpl:
    def __init__(self, model, args: ModelArgs, device):
        self.model_, self.device_ = model, device
        self.persistent_param_ = GraphPersistentParam(args, device)
        self.graphs_: dict = {}
        events.shared_outputs("xllm GraphPersistentParam", {"hidden_states_": self.persistent_param_.hidden_states_})

    @staticmethod
    def get_bucket_num_tokens(num_tokens: int) -> int:
        if num_tokens <= 2:
            return max(num_tokens, 1)
        if num_tokens <= 4:
            return 4
        if num_tokens <= 8:
            return 8
        return (num_tokens + 15) // 16 * 16

    def run(self, tokens, positions, kv_caches, params: ModelInputParams) -> Tensor:
        if not params.is_decode:                       # prefill: eager, no graph
            return self.model_.forward(tokens, positions, kv_caches, params)
        bucket = self.get_bucket_num_tokens(tokens.shape[0])
        if bucket in self.graphs_:
            return self.graphs_[bucket].replay(tokens, positions, params)
        graph = AclGraph(self.persistent_param_, self.device_)            # lazy capture on the bucket's first step
        out = graph.capture(self.model_, tokens, positions, params, kv_caches, bucket)
        self.graphs_[bucket] = graph
        return out


class ExecutorImplFactory:
    @staticmethod
    def create_executor_impl(model, args, device, backend: str, enable_graph: bool):
        if enable_graph:                               # FLAGS_enable_graph: the device's graph executor, any backend
            backend = "npu"
        return {"npu": AclGraphExecutorImpl, "vlm": VlmExecutorImpl}[backend](model, args, device)


class VLMWorkerImpl:
    def __init__(self, device, enable_graph: bool):
        self.args_ = ModelArgs()
        self.model_ = Qwen2_5_VLForConditionalGeneration(self.args_, device)
        self.kv_caches_ = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device),
                            torch.zeros(NUM_BLOCKS * BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device))
                           for _ in range(NUM_LAYERS)]
        self.model_executor_ = ExecutorImplFactory.create_executor_impl(self.model_, self.args_, device, "vlm",
                                                                       enable_graph)

    def step(self, inp: ForwardInput) -> Tensor:
        hidden_states = self.model_executor_.run(inp.token_ids, inp.positions, self.kv_caches_, inp.input_params)
        return self.model_.logits(hidden_states, inp.selected_token_idxes)


def serve(device, enable_graph: bool) -> list:
    worker = VLMWorkerImpl(device, enable_graph)
    builder = BatchInputBuilder(worker.args_)
    running = [Sequence([3, 17, 5, 9, 21, 1], 6, [1, 2, 3], 4), Sequence([8, 2, 20, 11], 4, [4, 5, 6], 7)]
    outputs = []
    while running:
        inp = builder.build_forward_input(running, device)
        logits = worker.step(inp)
        next_tokens = logits.argmax(-1)                # greedy sampler
        outputs += [logits.clone(), next_tokens.clone()]
        for seq, tok in zip(running, next_tokens.tolist()):
            seq.kv_cache_tokens_num = seq.num_tokens()
            seq.tokens.append(tok)
        running = [s for s in running if not s.finished()]
    return outputs + [c.clone() for kv in worker.kv_caches_ for c in kv]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, enable_graph=True), lambda: serve(device, enable_graph=False))
