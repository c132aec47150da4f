"""sglang MTP + DP attention: the logits processor stores a device tensor as the local DP buffer length, and the next draft forward's ``torch.empty`` reads it on the host during capture.

Upstream: https://github.com/sgl-project/sglang/pull/10392 ("[Fix] Support qwen3-next MTP+DP", merged September 2025). Read:
the title and description. Its first item is "Fix `set_dp_buffer_len` logic in logits_processor.py which accidentally
pass `torch.tensor([1])` as a `int` argument to `set_dp_buffer_len` method which breaks cuda graph capture
occassionally". The diff was not read. The PR's model-specific items (a Qwen3-Next MTP idle-batch norm bypass, pool
sizing, ``num_nextn_predict_layers``) were not read either and are not modelled. I did read the DP-buffer helpers of that
time: ``_DpGatheredBufferWrapper.set_dp_buffer_len(global_dp_buffer_len: int, local_dp_buffer_len: int,
global_num_tokens=None)`` and ``get_local_dp_buffer()``, which is ``torch.empty((cls._local_dp_buffer_len, hidden))``.
I read the runners' ``run_once``, which calls ``set_dp_buffer_len(global_dp_buffer_len, num_tokens)`` before each
captured forward. I also read the later ``LogitsMetadata.compute_dp_attention_metadata``. It keeps
``self.dp_local_num_tokens = self.global_num_tokens_for_logprob_gpu[dp_rank]`` (a device tensor) and allocates its own
``gathered_buffer`` instead of touching the shared lengths.
Symptom: Qwen3-Next with MTP and ``--enable-dp-attention``: capturing the draft model's CUDA graphs fails ("operation
not permitted when stream is capturing"), so the server does not start. Without DP attention, or when the draft model
runs only once per round, capture works. Eager decoding (``--disable-cuda-graph``) is correct.
Mechanism: ``EAGLEDraftCudaGraphRunner.capture_one_batch_size`` runs ``run_once``, which sets the DP buffer lengths to
ints (``set_dp_buffer_len(global_dp_buffer_len, num_tokens)``), then ``EAGLEWorker.draft_forward``. That runs the draft
model after every speculative step but the last. In each run the decoder layer's ``LayerCommunicator`` gathers the DP
ranks' tokens into ``get_global_dp_buffer()`` before the TP MLP and scatters them back into ``get_local_dp_buffer()``.
Then the ``LogitsProcessor`` calls ``LogitsMetadata.compute_dp_attention_metadata``. Before the fix, that called
``set_dp_buffer_len(self.global_dp_buffer_len, self.dp_local_num_tokens, ...)``, and ``dp_local_num_tokens`` is an
element of ``global_num_tokens_for_logprob_gpu``, a device tensor. The next run's ``get_local_dp_buffer()`` then calls
``torch.empty((tensor, hidden))``. Turning that tensor into a size reads it on the host (``_local_scalar_dense``). Eagerly
that is only a sync, but inside the capture the stream refuses it.
Doctor: sync-in-capture, at compute_dp_attention_metadata. The failure is a host read of device memory during capture
(a size taken from a device tensor). Its cause is the tensor ``compute_dp_attention_metadata`` publishes where an int
belongs, and the fix is there.
Fix (upstream): the logits processor no longer resets the shared DP buffer lengths with a tensor. Modelled as the later
code has it: ``compute_dp_attention_metadata`` allocates its own ``gathered_buffer`` of ``global_dp_buffer_len`` rows.
Modelled: ``EAGLEDraftCudaGraphRunner`` (static ``input_ids``, ``positions``, ``hidden_states``, ``topk_p``,
``topk_index``, ``global_num_tokens_gpu`` and ``global_num_tokens_for_logprob_gpu``; capture sizes 1, 2; MAX_LEN DP
padding). Also ``EAGLEWorker.draft_forward`` with ``select_top_k_tokens``, for topk 1 and 3 speculative steps, so the
draft model runs twice per round. Also ``_DpGatheredBufferWrapper``, ``dp_gather``/``dp_scatter``, the communicator,
and ``LogitsProcessor`` with ``LogitsMetadata``. This process is attention-DP rank 0 of 2. The all-reduce that
completes a gather is a stand-in: the peer's rows stay zero. Nothing the model does mixes rows, so this rank's tokens
get what the collective gives them. The draft layer is an MTP layer reduced to the token embedding fused with the target
hidden state and one DP-gathered MLP. It has no attention, which plays no part here.
Workload: the draft-extend outputs (top-1 token and probability, target hidden state) of 2 requests for 2 rounds
(bs=2, a captured size), then of one request alone (bs=1). Each round drafts 3 tokens. Eager drafts all rounds. With
graphs, capture of the first size (bs=2) fails in its second draft-model run, so nothing is served. The fix captures
and matches eager.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/10392"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "compute_dp_attention_metadata"
SYMPTOM = ("MTP + DP attention: capturing the draft CUDA graph fails; the logits processor set the local DP buffer "
           "length to a device tensor, and the next speculative step's torch.empty((len, hidden)) reads it on the host")

VOCAB, HIDDEN = 16, 8
DP_SIZE, DP_RANK = 2, 0
SPECULATIVE_NUM_STEPS, TOPK = 3, 1
CAPTURE_BS = [1, 2]

_variant = "bug"


# --- sglang/srt/layers/dp_attention.py -----------------------------------------------------------------------------------

class _DpGatheredBufferWrapper:
    _hidden_size: int
    _dtype: torch.dtype
    _device: torch.device
    _global_dp_buffer_len: int
    _local_dp_buffer_len: int
    _global_num_tokens = None

    @classmethod
    def set_metadata(cls, hidden_size, dtype, device):
        cls._hidden_size, cls._dtype, cls._device = hidden_size, dtype, device

    @classmethod
    def set_dp_buffer_len(cls, global_dp_buffer_len: int, local_dp_buffer_len: int, global_num_tokens=None):
        cls._global_dp_buffer_len = global_dp_buffer_len
        cls._local_dp_buffer_len = local_dp_buffer_len
        cls._global_num_tokens = global_num_tokens

    @classmethod
    def get_global_dp_buffer(cls):
        return torch.empty((cls._global_dp_buffer_len, cls._hidden_size), dtype=cls._dtype, device=cls._device)

    @classmethod
    def get_local_dp_buffer(cls):
        return torch.empty((cls._local_dp_buffer_len, cls._hidden_size), dtype=cls._dtype, device=cls._device)


set_dp_buffer_len = _DpGatheredBufferWrapper.set_dp_buffer_len
get_global_dp_buffer = _DpGatheredBufferWrapper.get_global_dp_buffer
get_local_dp_buffer = _DpGatheredBufferWrapper.get_local_dp_buffer


def _dp_local_info(global_num_tokens_gpu):
    cumtokens = torch.cumsum(global_num_tokens_gpu, dim=0)
    start = cumtokens[DP_RANK] - global_num_tokens_gpu[DP_RANK]
    return start, global_num_tokens_gpu[DP_RANK]


def dp_gather(global_tokens, local_tokens, global_num_tokens_gpu):
    """``global_tokens.fill_(0)``, copy this rank's rows at its offset (device-side offsets), then the all-reduce over
    the attention-TP group (stand-in: one process, the peer's rows stay zero)."""
    start, _ = _dp_local_info(global_num_tokens_gpu)
    global_tokens.fill_(0)
    idx = start + torch.arange(local_tokens.shape[0], device=local_tokens.device)
    global_tokens.index_copy_(0, idx, local_tokens)


def dp_scatter(local_tokens, global_tokens, global_num_tokens_gpu):
    start, _ = _dp_local_info(global_num_tokens_gpu)
    idx = start + torch.arange(local_tokens.shape[0], device=local_tokens.device)
    local_tokens.copy_(global_tokens.index_select(0, idx))


class ForwardBatch:
    def __init__(self, input_ids, positions, hidden_states, topk_p, topk_index, global_num_tokens_gpu,
                 global_num_tokens_for_logprob_gpu, global_num_tokens_for_logprob_cpu, global_dp_buffer_len):
        self.batch_size = input_ids.shape[0]
        self.input_ids, self.positions, self.hidden_states = input_ids, positions, hidden_states
        self.topk_p, self.topk_index = topk_p, topk_index
        self.global_num_tokens_gpu = global_num_tokens_gpu
        self.global_num_tokens_for_logprob_gpu = global_num_tokens_for_logprob_gpu
        self.global_num_tokens_for_logprob_cpu = global_num_tokens_for_logprob_cpu
        self.global_dp_buffer_len = global_dp_buffer_len


# --- sglang/srt/layers/logits_processor.py -------------------------------------------------------------------------------

class LogitsMetadata:
    def __init__(self, forward_batch):
        self.global_num_tokens_for_logprob_gpu = forward_batch.global_num_tokens_for_logprob_gpu
        self.global_num_tokens_for_logprob_cpu = forward_batch.global_num_tokens_for_logprob_cpu
        self.global_dp_buffer_len = forward_batch.global_dp_buffer_len
        self.gathered_buffer = None

    def compute_dp_attention_metadata(self):
        cumtokens = torch.cumsum(self.global_num_tokens_for_logprob_gpu, dim=0)
        self.dp_local_start_pos = cumtokens[DP_RANK] - self.global_num_tokens_for_logprob_gpu[DP_RANK]
        self.dp_local_num_tokens = self.global_num_tokens_for_logprob_gpu[DP_RANK]       # a device tensor
        if self.global_num_tokens_for_logprob_cpu is not None:
            # create a smaller buffer to reduce peak memory usage
            self.global_dp_buffer_len = sum(self.global_num_tokens_for_logprob_cpu)
        if _variant == "bug":
            set_dp_buffer_len(self.global_dp_buffer_len, self.dp_local_num_tokens,
                              self.global_num_tokens_for_logprob_cpu)
        else:
            self.gathered_buffer = torch.empty((self.global_dp_buffer_len, _DpGatheredBufferWrapper._hidden_size),
                                               dtype=_DpGatheredBufferWrapper._dtype,
                                               device=_DpGatheredBufferWrapper._device)


class LogitsProcessor:
    def __init__(self, lm_head):
        self.lm_head = lm_head

    def forward(self, hidden_states, logits_metadata):
        logits_metadata.compute_dp_attention_metadata()
        local_hidden_states = hidden_states
        hidden_states = (get_global_dp_buffer() if logits_metadata.gathered_buffer is None
                         else logits_metadata.gathered_buffer)
        dp_gather(hidden_states, local_hidden_states, logits_metadata.global_num_tokens_for_logprob_gpu)
        global_logits = hidden_states @ self.lm_head
        logits = torch.empty((local_hidden_states.shape[0], global_logits.shape[1]), dtype=global_logits.dtype,
                             device=global_logits.device)
        dp_scatter(logits, global_logits, logits_metadata.global_num_tokens_for_logprob_gpu)
        return logits, local_hidden_states


# --- the MTP draft model (sglang/srt/models/*_mtp.py, reduced) ------------------------------------------------------------

class DraftModel:
    def __init__(self, device):
        gen = generator(10392)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(16, HIDDEN, scale=0.3)
        self.eh_proj = r(2 * HIDDEN, HIDDEN, scale=0.4)
        self.w_up, self.w_down = r(HIDDEN, 2 * HIDDEN, scale=0.5), r(2 * HIDDEN, HIDDEN, scale=0.5)
        self.logits_processor = LogitsProcessor(r(HIDDEN, VOCAB, scale=0.7))

    def mlp_with_dp_gather(self, hidden_states, forward_batch):
        """``LayerCommunicator``: gather the DP ranks' tokens for the TP MLP, then scatter back."""
        local_hidden_states = hidden_states
        hidden_states = get_global_dp_buffer()
        dp_gather(hidden_states, local_hidden_states, forward_batch.global_num_tokens_gpu)
        hidden_states = torch.relu(hidden_states @ self.w_up) @ self.w_down
        hidden_states, global_hidden_states = get_local_dp_buffer(), hidden_states
        dp_scatter(hidden_states, global_hidden_states, forward_batch.global_num_tokens_gpu)
        return hidden_states

    def forward(self, input_ids, positions, forward_batch):
        x = torch.cat([self.embed[input_ids] + self.pos_embed[positions], forward_batch.hidden_states], -1)
        h = torch.tanh(x @ self.eh_proj)
        h = h + self.mlp_with_dp_gather(h, forward_batch)
        return self.logits_processor.forward(h, LogitsMetadata(forward_batch))


def select_top_k_tokens(i, topk_p, topk_index, hidden_states, scores, topk):
    """topk = 1: the chosen token of each request is the next input; its path score multiplies along the chain."""
    input_ids = topk_index.flatten()
    scores = topk_p if i == 0 else scores * topk_p
    return input_ids, hidden_states, scores


class EAGLEWorker:
    def __init__(self, device):
        self.model = DraftModel(device)
        _DpGatheredBufferWrapper.set_metadata(HIDDEN, torch.float32, torch.device(device))

    def draft_forward(self, forward_batch):
        topk_p, topk_index, hidden_states = forward_batch.topk_p, forward_batch.topk_index, forward_batch.hidden_states
        positions, scores = forward_batch.positions, None
        score_list, token_list = [], []
        for i in range(SPECULATIVE_NUM_STEPS):
            input_ids, hidden_states, scores = select_top_k_tokens(i, topk_p, topk_index, hidden_states, scores, TOPK)
            score_list.append(scores)
            token_list.append(input_ids.unsqueeze(1).to(torch.float32))
            if i == SPECULATIVE_NUM_STEPS - 1:
                break
            forward_batch.hidden_states = hidden_states
            positions = positions + 1
            logits, hidden_states = self.model.forward(input_ids, positions, forward_batch)
            topk_p, topk_index = torch.softmax(logits, -1).topk(TOPK, dim=-1)
        return torch.cat(score_list, -1), torch.cat(token_list, -1)


# --- sglang/srt/speculative/eagle_draft_cuda_graph_runner.py -------------------------------------------------------------

class EAGLEDraftCudaGraphRunner:
    def __init__(self, eagle_worker, device):
        self.eagle_worker, self.device = eagle_worker, device
        self.capture_bs, self.max_bs = CAPTURE_BS, max(CAPTURE_BS)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(self.max_bs, HIDDEN, device=device)
        self.topk_p = torch.zeros(self.max_bs, TOPK, device=device)
        self.topk_index = torch.zeros(self.max_bs, TOPK, dtype=torch.int64, device=device)
        self.global_num_tokens_gpu = torch.zeros(DP_SIZE, dtype=torch.int32, device=device)
        self.global_num_tokens_for_logprob_gpu = torch.zeros(DP_SIZE, dtype=torch.int32, device=device)
        self.graphs, self.output_buffers = {}, {}
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, num_seqs):
        num_tokens = num_seqs * TOPK
        self.global_num_tokens_gpu.fill_(num_tokens)               # MAX_LEN padding: every DP rank has num_tokens
        self.global_num_tokens_for_logprob_gpu.fill_(num_tokens)
        global_dp_buffer_len = num_tokens * DP_SIZE
        fb = ForwardBatch(self.input_ids[:num_tokens], self.positions[:num_tokens], self.hidden_states[:num_seqs],
                          self.topk_p[:num_seqs], self.topk_index[:num_seqs], self.global_num_tokens_gpu,
                          self.global_num_tokens_for_logprob_gpu, None, global_dp_buffer_len)
        hidden_states_backup = fb.hidden_states

        def run_once():
            set_dp_buffer_len(global_dp_buffer_len, num_tokens)
            ret = self.eagle_worker.draft_forward(fb)
            fb.hidden_states = hidden_states_backup
            return ret

        return capture(run_once, device=self.device, warmups=2, name=f"draft bs={num_seqs}",
                       owner="EAGLEDraftCudaGraphRunner",
                       static={"input_ids": self.input_ids, "positions": self.positions,
                               "hidden_states": self.hidden_states, "topk_p": self.topk_p,
                               "topk_index": self.topk_index,
                               "global_num_tokens_gpu": self.global_num_tokens_gpu,
                               "global_num_tokens_for_logprob_gpu": self.global_num_tokens_for_logprob_gpu})

    def replay(self, forward_batch):
        raw_bs = forward_batch.batch_size
        bs = next(b for b in self.capture_bs if b >= raw_bs)
        if bs != raw_bs:
            self.positions.zero_(), self.topk_p.zero_(), self.topk_index.zero_(), self.hidden_states.zero_()
        self.positions[:raw_bs].copy_(forward_batch.positions)
        self.topk_p[:raw_bs].copy_(forward_batch.topk_p)
        self.hidden_states[:raw_bs].copy_(forward_batch.hidden_states)
        self.topk_index[:raw_bs].copy_(forward_batch.topk_index)
        self.global_num_tokens_gpu.fill_(bs * TOPK)
        self.global_num_tokens_for_logprob_gpu.fill_(bs * TOPK)
        scores, tokens = replay(self.graphs[bs], self.output_buffers[bs], real=raw_bs, size=bs)
        return scores[:raw_bs], tokens[:raw_bs]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(10393)
    rounds = []                       # draft-extend output per request, per round: topk_p, topk_index, position, hidden
    for step, bs in enumerate((2, 2, 1)):
        rounds.append((torch.rand(bs, TOPK, generator=gen), torch.randint(0, VOCAB, (bs, TOPK), generator=gen),
                       torch.tensor([5 + step, 9 + step][:bs]), torch.randn(bs, HIDDEN, generator=gen)))

    def serve(use_cuda_graph: bool):
        worker = EAGLEWorker(device)
        runner = EAGLEDraftCudaGraphRunner(worker, device) if use_cuda_graph else None
        outs = []
        for topk_p, topk_index, positions, hidden in rounds:
            bs = topk_index.shape[0]
            fb = ForwardBatch(topk_index.flatten().to(device), positions.to(device), hidden.to(device),
                              topk_p.to(device), topk_index.to(device),
                              torch.tensor([bs, bs], dtype=torch.int32, device=device),
                              torch.tensor([bs, bs], dtype=torch.int32, device=device), [bs, bs], 2 * bs)
            if runner is not None:
                scores, tokens = runner.replay(fb)
            else:
                set_dp_buffer_len(fb.global_dp_buffer_len, bs, [bs, bs])   # prepare_mlp_sync_batch, eager
                scores, tokens = worker.draft_forward(fb)
            outs += [scores.clone(), tokens.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
