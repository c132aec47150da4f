"""gLLM captures decode graphs for buckets up to ``max_cuda_graph_bs`` (clamped only to ``maxd``); a bucket larger than ``max_num_batched_tokens`` writes more rows than the activation buffers hold and the capture dies.

Upstream: https://github.com/gty111/gLLM/pull/245 ("Fix pp gdn", gty111/gLLM, merged 2026-07-17 as commit
e8dedd1cf295 by Tianyu Guo). Read: the diff of ``gllm/model_runner.py`` (the rewritten clamp in
``ModelRunner.__init__`` and its comment), and at the parent commit ``ModelRunner.__init__`` (``max_num_batched_tokens =
maxp`` under ``chunked_prefill`` / ``split_pd``, else ``maxp + maxd``; ``max_running_seqs = maxd``; the old clamp
``if max_cuda_graph_bs > maxd``), ``_build_capture_sizes``, ``init`` (the ``input_hidden_states`` /
``output_hidden_states`` buffers of ``max_num_batched_tokens`` rows, ``profile_run``, ``memory_manager.init``,
``capture_graph``), ``create_dummy_seqs``, ``create_dummy_prefill_seqs``, ``profile_run``, ``capture_graph``,
``forward``, ``step_once``; and ``gllm/input_data.py`` (buffers, ``cal_input``, ``copy_to_input_buffer``,
``_cal_slot_mapping``, ``pad_for_cuda_graph``). The PR's other changes (pipeline parallelism for GDN models) are not
modelled. No issue is linked; the symptom is the one the new comment states.
Symptom: starting gLLM with a small ``--maxp`` under chunked prefill (the comment's example: ``--maxp 256`` with the
``--max-cuda-graph-bs`` default of 512) crashes in ``capture_graph``: "tried to write 512 rows into a 256-row buffer
and crashed with a shape mismatch on ``ssm_state_indices`` / the output hidden states". With ``--disable-cuda-graph``
the server starts and serves.
Mechanism: ``__init__`` clamps ``max_cuda_graph_bs`` to ``maxd`` only, because the input buffers of ``InputData`` have
``maxd`` rows. But a captured decode graph of ``B`` sequences also makes ``B`` token rows of activations, and
``forward`` stores them into ``output_hidden_states[:num_cal_tokens]``, a buffer of ``max_num_batched_tokens`` rows
(``maxp`` under chunked prefill). ``capture_graph`` captures the buckets largest first, so its first capture asks the
``max_num_batched_tokens``-row buffer to take ``B > max_num_batched_tokens`` rows. A real forward never has more
tokens than ``max_num_batched_tokens`` (decode spends the same per-step budget as prefill), so such a bucket would
never be replayed anyway.
Doctor: undersized-buffer, at __init__. The captured step writes more rows than the static activation buffer was
allocated with; ``__init__`` is where the capture sizes are bounded, and the bound it uses leaves that buffer out.
Fix (upstream): ``cuda_graph_cap = min(maxd, self.max_num_batched_tokens)``; ``max_cuda_graph_bs`` is clamped to it
(with a warning), so ``_build_capture_sizes`` never yields a bucket the buffers cannot hold.
Modelled: ``ModelRunner`` (``__init__`` with both clamps, ``_build_capture_sizes``, ``init``, ``create_dummy_seqs``,
``create_dummy_prefill_seqs``, ``profile_run``, ``capture_graph``, ``forward``, ``check_decode_batch``, ``step_once``),
``InputData`` (the buffers it has, ``cal_input``, ``copy_to_input_buffer``, ``cal_and_set_input``, the ``get_*``
views, ``pad_for_cuda_graph``), ``Sequence`` and ``MemoryManager`` (pages, the reserved dummy page, ``segment`` built
by ``init`` after the profile run) as gLLM has them, cut to what a one-GPU, no-PP, no-MM, no-MLA, no-SSM run uses.
Stand-ins: the model is a one-layer decoder (embedding, RMSNorm, q/k/v, paged causal attention over the
``block_table`` as ``FlashAttention.forward`` does with ``flash_attn_with_kvcache``, o-proj, SiLU MLP, norm, lm_head);
``compute_logits`` takes each sequence's last token; the sampler is greedy; the scheduler is a few lines of chunked
prefill (at most ``maxp`` tokens a step) followed by pure decode steps. Streams, the custom all-reduce context, DP
counts and the per-bucket FP8 warmup are left out. Sizes are scaled: ``maxd`` 8, ``maxp`` 4, ``max_cuda_graph_bs``
default 8 (upstream 512), page size 2, float64.
Workload: three prompts (3, 2 and 3 tokens) prefilled in chunks of 4 tokens, then greedy decode of 4, 2 and 3 tokens
(decode batches of 3, 2 and 1 requests; the first is padded to bucket 4). The bug's ``init`` raises at the capture of bucket
8 (RuntimeError: the expanded size of the 4-row ``output_hidden_states`` slice must match the 8 rows the model made),
as gLLM did at startup; the fix captures buckets 4, 2, 1 and its per-step logits and tokens equal eager (max error 0).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/gty111/gLLM/pull/245"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "__init__"
SYMPTOM = ("gLLM with a small --maxp under chunked prefill crashes while capturing decode graphs: the largest bucket "
           "(max_cuda_graph_bs, clamped only to maxd) writes more token rows than the max_num_batched_tokens-row "
           "output_hidden_states buffer holds")

VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, FFN = 16, 4, 2, 2, 8
PAGE_SIZE, NUM_PAGES, MODEL_MAX_LENGTH = 2, 16, 8
MAXP, MAXD, MAX_CUDA_GRAPH_BS = 4, 8, 8          # --maxp, --maxd, --max-cuda-graph-bs (scaled down)
SCHEDULE_METHOD = "chunked_prefill"
DTYPE = torch.float64
PROMPTS = ([3, 7, 1], [5, 2], [9, 4, 11])
OUTPUT_LENS = (4, 2, 3)

_variant = "bug"


# --- gllm/sequence.py ------------------------------------------------------------------------------------------------

class Sequence:
    def __init__(self, seq_id, token_ids, page_table, output_len):
        self.seq_id, self.token_ids, self.page_table, self.output_len = seq_id, list(token_ids), list(page_table), output_len
        self.prompt_len = len(token_ids)
        self.computed_token_num = 0
        self.to_compute_token_num = 0

    @property
    def seq_len(self):                      # length once this step's tokens are computed
        return self.computed_token_num + self.to_compute_token_num

    @property
    def computed_prompt(self):
        return self.computed_token_num >= self.prompt_len

    def __getitem__(self, item):
        return self.token_ids[item]


# --- gllm/memory_manager.py (pages, the reserved dummy page, the KV segment built after profiling) -------------------

class Segment:
    def __init__(self, device):
        self.k_cache = torch.zeros(NUM_PAGES * PAGE_SIZE, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)


class MemoryManager:
    def __init__(self, device, page_size):
        self.device, self.page_size = device, page_size
        self.segment = None
        self.dummy_page = None
        self.free_pages = []

    def init(self, reserve_dummy_page: bool):
        self.segment = Segment(self.device)
        self.free_pages = list(range(NUM_PAGES))
        if reserve_dummy_page:
            self.dummy_page = self.free_pages.pop()            # never handed to a real sequence

    def allocate(self, seq):
        while len(seq.page_table) * self.page_size < seq.seq_len:
            seq.page_table.append(self.free_pages.pop(0))


# --- gllm/input_data.py ----------------------------------------------------------------------------------------------

class InputData:
    def __init__(self, use_buffer, memory_manager, max_seq_length, max_running_seqs, device):
        self.page_size = memory_manager.page_size
        self.max_num_block = (max_seq_length + self.page_size - 1) // self.page_size
        self.memory_manager, self.use_buffer = memory_manager, use_buffer
        self.tokens = torch.zeros(max_seq_length, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_seq_length, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_seq_length * max_running_seqs, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_running_seqs, self.max_num_block, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_running_seqs, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_running_seqs + 1, dtype=torch.int64, device=device)

    def cal_input(self, seqs):
        self.seqs = seqs
        self.tokens_cpu = torch.tensor([t for s in seqs for t in s[s.computed_token_num:s.seq_len]], dtype=torch.long)
        self.positions_cpu = torch.tensor([p for s in seqs for p in range(s.computed_token_num, s.seq_len)])
        self.slot_mapping_cpu = torch.tensor([s.page_table[p // self.page_size] * self.page_size + p % self.page_size
                                              for s in seqs for p in range(s.computed_token_num, s.seq_len)])
        width = max(len(s.page_table) for s in seqs)
        self.block_table_cpu = torch.zeros(len(seqs), width, dtype=torch.int64)
        for i, s in enumerate(seqs):
            self.block_table_cpu[i, :len(s.page_table)] = torch.tensor(s.page_table)
        self.seq_lens_cpu = torch.tensor([s.seq_len for s in seqs])
        self.query_start_loc_cpu = torch.cumsum(torch.tensor([0] + [s.to_compute_token_num for s in seqs]), 0)

    def copy_to_input_buffer(self):
        self.tokens[: self.tokens_cpu.shape[0]].copy_(self.tokens_cpu)
        self.positions[: self.positions_cpu.shape[0]].copy_(self.positions_cpu)
        self.slot_mapping[: self.slot_mapping_cpu.shape[0]].copy_(self.slot_mapping_cpu)
        bs_, used_cols = self.block_table_cpu.shape
        self.block_table[:bs_, :used_cols].copy_(self.block_table_cpu)
        self.seq_lens[: self.seq_lens_cpu.shape[0]].copy_(self.seq_lens_cpu)
        self.query_start_loc[: self.query_start_loc_cpu.shape[0]].copy_(self.query_start_loc_cpu)

    def cal_and_set_input(self, seqs):
        self.cal_input(seqs)
        self.copy_to_input_buffer()

    def get_tokens(self): return self.tokens[: self.tokens_cpu.shape[0]]                            # noqa: E704
    def get_position(self): return self.positions[: self.positions_cpu.shape[0]]                    # noqa: E704
    def get_slot_mapping(self): return self.slot_mapping[: self.slot_mapping_cpu.shape[0]]          # noqa: E704
    def get_block_table(self): return self.block_table[: self.block_table_cpu.shape[0]]             # noqa: E704
    def get_seq_lens(self): return self.seq_lens[: self.seq_lens_cpu.shape[0]]                      # noqa: E704
    def get_query_start_loc(self): return self.query_start_loc[: self.query_start_loc_cpu.shape[0]]  # noqa: E704

    def pad_for_cuda_graph(self, padded_size: int):
        num_real_tokens = self.tokens_cpu.shape[0]
        if num_real_tokens >= padded_size:
            return num_real_tokens
        dummy_page = self.memory_manager.dummy_page
        dummy_slot = dummy_page * self.page_size
        num_pad, n = padded_size - num_real_tokens, len(self.seqs)
        self.tokens[num_real_tokens:padded_size].zero_()
        self.positions[num_real_tokens:padded_size].zero_()
        self.slot_mapping[num_real_tokens:padded_size].fill_(dummy_slot)
        self.seq_lens[n:n + num_pad].fill_(1)
        self.block_table[n:n + num_pad].fill_(dummy_page)
        last_loc = self.query_start_loc[n]
        self.query_start_loc[n + 1:n + num_pad + 1].copy_(
            last_loc + torch.arange(1, num_pad + 1, dtype=torch.int64, device=self.tokens.device))
        return num_real_tokens


# --- the model (stand-in: one decoder layer; attention reads the paged KV cache as FlashAttention.forward does) -------

def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class FlashAttention:
    def forward(self, q, k, v, input_data):
        if input_data.memory_manager.segment is None:              # profile run: no KV segment yet
            return q
        seg = input_data.memory_manager.segment
        q, k, v = (t.view(-1, NUM_HEADS, HEAD_DIM) for t in (q, k, v))
        slots = input_data.get_slot_mapping()
        seg.k_cache[slots] = k
        seg.v_cache[slots] = v
        qsl, positions = input_data.get_query_start_loc(), input_data.get_position()
        token_idx = torch.arange(q.shape[0], device=q.device)
        seq_idx = torch.searchsorted(qsl[1:], token_idx, right=True)
        kv_pos = torch.arange(input_data.max_num_block * PAGE_SIZE, device=q.device)
        pages = input_data.get_block_table()[seq_idx][:, kv_pos // PAGE_SIZE]
        kv_slots = pages * PAGE_SIZE + kv_pos % PAGE_SIZE                          # [tokens, max_len]
        keys, values = seg.k_cache[kv_slots], seg.v_cache[kv_slots]                # [tokens, max_len, heads, dim]
        valid = (kv_pos[None] <= positions[:, None]) & (kv_pos[None] < input_data.get_seq_lens()[seq_idx][:, None])
        scores = torch.einsum("thd,tlhd->thl", q, keys) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        out = torch.einsum("thl,tlhd->thd", torch.softmax(scores, dim=-1), values)
        return out.reshape(-1, NUM_HEADS * HEAD_DIM)


class TinyForCausalLM:
    def __init__(self, device):
        gen = generator(245)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.w_q, self.w_k, self.w_v, self.w_o = (r(HIDDEN, NUM_HEADS * HEAD_DIM) for _ in range(4))
        self.w_gate, self.w_up, self.w_down = r(HIDDEN, FFN), r(HIDDEN, FFN), r(FFN, HIDDEN)
        self.ln1, self.ln2, self.norm = (1.0 + r(HIDDEN, scale=0.1) for _ in range(3))
        self.lm_head = r(HIDDEN, VOCAB)
        self.attn = FlashAttention()

    def __call__(self, input_data):
        h = self.embed_tokens[input_data.get_tokens()]
        x = rms_norm(h, self.ln1)
        h = h + self.attn.forward(x @ self.w_q, x @ self.w_k, x @ self.w_v, input_data) @ self.w_o
        x = rms_norm(h, self.ln2)
        return h + (torch.nn.functional.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down

    def compute_logits(self, input_data, hidden_states):
        last = input_data.query_start_loc_cpu[1:] - 1                  # each sequence's last token (host indices)
        return rms_norm(hidden_states[last.to(hidden_states.device)], self.norm) @ self.lm_head


# --- gllm/model_runner.py --------------------------------------------------------------------------------------------

class ModelRunner:
    def __init__(self, device, page_size, maxp, maxd, schedule_method, disable_cuda_graph, max_cuda_graph_bs,
                 model_max_length):
        self.device, self.page_size = device, page_size
        self.max_num_batched_tokens = maxp if schedule_method in ["chunked_prefill", "split_pd"] else maxp + maxd
        self.max_running_seqs = maxd
        self.hidden_size = HIDDEN
        self.model = self.memory_manager = self.input_data = self.output_hidden_states = None   # lazy init
        # cuda graph
        self.disable_cuda_graph = disable_cuda_graph
        if _variant == "bug":
            # ``max_cuda_graph_bs`` cannot exceed ``maxd`` (the decode batch and the InputData buffers' rows)
            if max_cuda_graph_bs > maxd:
                max_cuda_graph_bs = maxd
        else:
            # ... nor ``max_num_batched_tokens``: a captured decode graph of B sequences writes B token rows into
            # the activation buffers, which are sized to ``max_num_batched_tokens``
            cuda_graph_cap = min(maxd, self.max_num_batched_tokens)
            if max_cuda_graph_bs > cuda_graph_cap:
                max_cuda_graph_bs = cuda_graph_cap
        self.max_cuda_graph_bs = max_cuda_graph_bs
        self.size_to_graph, self.size_to_output = {}, {}
        self.capture_sizes = self._build_capture_sizes(self.max_cuda_graph_bs)
        self.model_max_length = model_max_length

    @staticmethod
    def _build_capture_sizes(max_bs: int):
        if max_bs <= 0:
            return []
        sizes, s = [], 1
        while s <= max_bs:
            sizes.append(s)
            s *= 2
        if sizes[-1] != max_bs:
            sizes.append(max_bs)
        return list(reversed(sizes))

    def init(self):
        self.model = TinyForCausalLM(self.device)
        self.memory_manager = MemoryManager(self.device, self.page_size)
        self.input_data = InputData(True, self.memory_manager, self.model_max_length, self.max_running_seqs,
                                    self.device)
        self.output_hidden_states = torch.zeros(self.max_num_batched_tokens, self.hidden_size, dtype=DTYPE,
                                                device=self.device)
        self.profile_run()
        self.memory_manager.init(reserve_dummy_page=not self.disable_cuda_graph)
        if not self.disable_cuda_graph:
            self.capture_graph()

    def create_dummy_seqs(self, size):
        seqs = [Sequence(idx, [1, 2], [], output_len=1) for idx in range(size)]
        for seq in seqs:
            seq.page_table.append(seq.seq_id)
            seq.prompt_len = 1
            seq.computed_token_num = 1
            seq.to_compute_token_num = 1
        return seqs

    def create_dummy_prefill_seqs(self, total_tokens):
        seq = Sequence(0, [1] * total_tokens, range((total_tokens + self.page_size - 1) // self.page_size), 1)
        seq.to_compute_token_num = total_tokens
        return [seq]

    @torch.inference_mode()
    def profile_run(self):
        """A dummy prefill of ``max_num_batched_tokens`` tokens (the peak forward); it also warms up every kernel
        before ``capture_graph`` (upstream runs it again on the capture stream for that)."""
        self.input_data.cal_and_set_input(self.create_dummy_prefill_seqs(self.max_num_batched_tokens))
        self.model(self.input_data)

    @torch.inference_mode()
    def capture_graph(self):
        self.profile_run()
        memory_pool = graph_pool_handle(self.device)
        data = self.input_data
        for size in self.capture_sizes:                                   # largest bucket first
            self.input_data.cal_and_set_input(seqs=self.create_dummy_seqs(size))

            def step(size=size):
                self.forward()
                return self.output_hidden_states[:size]

            g, out = capture(step, device=self.device, pool=memory_pool, warmups=0, name=f"size {size}",
                             owner="gLLM ModelRunner",
                             static={"tokens": data.tokens, "positions": data.positions,
                                     "slot_mapping": data.slot_mapping, "block_table": data.block_table,
                                     "seq_lens": data.seq_lens, "query_start_loc": data.query_start_loc},
                             state={"k_cache": self.memory_manager.segment.k_cache,
                                    "v_cache": self.memory_manager.segment.v_cache})
            self.size_to_graph[size], self.size_to_output[size] = g, out

    @torch.inference_mode()
    def forward(self):
        num_cal_tokens = self.input_data.tokens_cpu.shape[0]
        output = self.model(self.input_data)
        self.output_hidden_states[:num_cal_tokens] = output

    def check_decode_batch(self):
        return self.input_data.seqs[-1].computed_prompt

    @torch.inference_mode()
    def step_once(self):
        num_cal_tokens = self.input_data.tokens_cpu.shape[0]
        hidden = None
        if not self.disable_cuda_graph and self.check_decode_batch():
            padded_size = None
            for bucket in self.capture_sizes:
                if bucket >= num_cal_tokens:
                    padded_size = bucket
            if padded_size is not None and padded_size in self.size_to_graph:
                num_real_tokens = self.input_data.pad_for_cuda_graph(padded_size)
                hidden = replay(self.size_to_graph[padded_size], self.size_to_output[padded_size],
                                real=num_real_tokens, size=padded_size)[:num_real_tokens]
        if hidden is None:
            self.forward()
            hidden = self.output_hidden_states[:num_cal_tokens]
        logits = self.model.compute_logits(self.input_data, hidden)
        return logits, logits.argmax(dim=-1)


# --- the scheduler (stand-in): chunked prefill of at most maxp tokens a step, then pure decode steps ------------------

def serve(device, disable_cuda_graph):
    runner = ModelRunner(device, PAGE_SIZE, MAXP, MAXD, SCHEDULE_METHOD, disable_cuda_graph, MAX_CUDA_GRAPH_BS,
                         MODEL_MAX_LENGTH)
    runner.init()
    mm = runner.memory_manager
    seqs = [Sequence(i, p, [], n) for i, (p, n) in enumerate(zip(PROMPTS, OUTPUT_LENS))]
    outputs = []
    while any(len(s.token_ids) - s.prompt_len < s.output_len for s in seqs):
        running = [s for s in seqs if len(s.token_ids) - s.prompt_len < s.output_len]
        if any(not s.computed_prompt for s in running):
            batch, budget = [], MAXP
            for s in running:
                if not s.computed_prompt and budget > 0:
                    s.to_compute_token_num = min(budget, s.prompt_len - s.computed_token_num)
                    budget -= s.to_compute_token_num
                    batch.append(s)
        else:
            batch = running
            for s in batch:
                s.to_compute_token_num = 1
        for s in batch:
            mm.allocate(s)
        runner.input_data.cal_and_set_input(batch)
        logits, next_tokens = runner.step_once()
        outputs.append(logits.clone())
        for s, tok in zip(batch, next_tokens.tolist()):
            s.computed_token_num += s.to_compute_token_num
            if s.computed_token_num == len(s.token_ids):                 # prompt done (or a decode step)
                s.token_ids.append(tok)
    outputs.append(torch.tensor([t for s in seqs for t in s.token_ids[s.prompt_len:]]))
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(device, False),
                   lambda: serve(device, True))
