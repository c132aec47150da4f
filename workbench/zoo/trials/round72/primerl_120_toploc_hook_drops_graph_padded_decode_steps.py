"""The TOPLOC logits-processor hook takes every graph-padded decode step for a prefill and drops its activations.

Upstream: https://github.com/PrimeIntellect-ai/prime-rl/pull/120 ("[fix] toploc proofs work with cuda graph
enabled", merged 2025-04-04, commit afd8395473ec2f47618e3a4465f67f5f2231e879).
Symptom: with vLLM (V0) CUDA graphs on (``enforce_eager=False``), the TOPLOC proofs written with each rollout
(the parquet ``proofs`` column, later checked by a validator that recomputes the activations) are built from a
subset of the decode activations whenever the decode batch is not exactly a captured batch size (sequences of
a batch finish at different lengths, so the batch shrinks through 3, 5, 6, 7, ...). They no longer match the
sequence's activations and verification of the rollouts fails; with ``enforce_eager`` the proofs are right.
Mechanism: ``src/zeroband/inference.py::inference`` registers ``logits_processor_hook`` as a forward pre-hook on
``model.logits_processor``; it receives ``(lm_head, hidden_states, sampling_metadata)`` and stores each decoding
sequence's last hidden state into the ``TopLocCache`` (``toploc_cache.add(seq_ids, hidden_states)``), from which
``_generate_proof`` builds the proof (top-k of the chunk's activations, ``build_proofs_bytes``). The hook told
decode steps from prefills by ``len(input[2].seq_groups) != input[1].shape[0]`` ("If the lengths dont match its
not a decode step"). vLLM V0's ``ModelInputForGPUBuilder`` pads a decode batch of ``bs`` sequences to the next
captured size ``graph_batch_size`` (dummy token 0, ``PAD_SLOT_ID`` slots, seq_len 1), ``CUDAGraphRunner.forward``
returns the whole ``output_buffers["hidden_states"]`` (``graph_batch_size`` rows) and ``LogitsProcessor`` prunes
to ``selected_token_indices`` only inside its ``forward``, after the pre-hook. So the hook, run on the graph's
padded-size hidden states, compares their row count with the real batch's ``seq_groups``: every padded decode
step fails the test and is silently skipped. The cache misses those activations, later ones slide into their
places and each proof covers the wrong activations. Eager decode steps have exactly one row per sequence.
Doctor: padded-shape-mismatch, at ``logits_processor_hook`` (code run on the graph's padded-size output combines
it with the real batch's sequence metadata: padded rows vs real ``seq_groups``; the fix changes only this hook).
Fix (upstream): the hook classifies prefills by ``max(sampling_metadata.selected_token_indices) >
len(sampling_metadata.seq_groups)``, prunes ``hidden_states = _prune_hidden_states(hidden_states,
sampling_metadata)`` (the real rows, "required when cuda graph padding is enabled") and raises if the lengths
still differ, then adds the pruned rows to the cache.
Modelled: vLLM V0 reduced to one attention layer with a contiguous per-sequence KV cache (one block of
``MAX_POS`` tokens per sequence, ``block_tables`` a row index), greedy sampling, captured decode sizes 1, 2, 4
sharing one pool; the scheduler runs one prefill of all prompts then decode steps until each sequence reaches its
``max_tokens``. ``TopLocCache`` as upstream but synchronous (no thread pool), ``max_len`` 8 instead of 32;
``build_proofs_bytes`` keeps the top-k points of the chunk (sorted indices and their values) instead of
encoding them as a ``ProofPoly``. The rollouts' proofs column (``get_parquet_table``) is the observable.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/PrimeIntellect-ai/prime-rl/pull/120"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "logits_processor_hook"
SYMPTOM = ("with CUDA graphs the TOPLOC hook skips every padded decode step (padded rows != seq_groups), so the "
           "rollouts' activation proofs are built from the wrong activations")

VOCAB, HIDDEN, MAX_POS = 16, 8, 16
MAX_SEQS = 4
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]
PAD_SLOT_ID = -1
TOPLOC_MAX_LEN, TOPK = 8, 8


# --- toploc ------------------------------------------------------------------------------------------------

def build_proofs_bytes(activations, decode_batching_size, topk, skip_prefill=False):
    """One proof per chunk of ``decode_batching_size`` decode activations: the top-k (by magnitude) points of
    the chunk's flattened activations (``ProofPoly.from_points(topk_indices, topk_values)``)."""
    proofs = []
    for i in range(0 if skip_prefill else 1, len(activations), decode_batching_size):
        flat_view = torch.cat([a.view(-1) for a in activations[i:i + decode_batching_size]])
        topk_indices = flat_view.abs().topk(topk).indices.sort().values
        topk_values = flat_view[topk_indices]
        proofs.append(torch.stack([topk_indices.to(flat_view.dtype), topk_values]))
    return proofs


# --- src/zeroband/inferencing/toploc.py ----------------------------------------------------------------------

class TopLocCache:
    def __init__(self, max_seqs, max_len, hidden_size, device=None):
        self.max_seqs, self.max_len, self.hidden_size, self.device = max_seqs, max_len, hidden_size, device
        self._cache = None
        self.proofs = {}

    def _init_cache(self, device, dtype):
        self._cache = torch.empty(self.max_seqs, self.max_len, self.hidden_size, device=device, dtype=dtype)
        self._seq_id_2_cache_index = {}
        self._current_seq_len = [0 for _ in range(self.max_seqs)]
        self._current_cache_index = 0

    def reset_cache(self):
        self.proofs = {}
        self._seq_id_2_cache_index = {}
        self._current_seq_len = [0 for _ in range(self.max_seqs)]
        self._current_cache_index = 0

    def add(self, seq_ids, values):
        assert len(seq_ids) == values.shape[0]
        if self._cache is None:
            self._init_cache(self.device or values.device, values.dtype)
        for i, seq_id in enumerate(seq_ids):
            if seq_id not in self._seq_id_2_cache_index:
                self._seq_id_2_cache_index[seq_id] = self._current_cache_index
                self._current_cache_index += 1
                self.proofs[seq_id] = []
            cache_index = self._seq_id_2_cache_index[seq_id]
            self._cache[cache_index, self._current_seq_len[cache_index]].copy_(values[i])
            self._current_seq_len[cache_index] += 1
        self.maybe_generate_proofs_in_background()

    def maybe_generate_proofs_in_background(self, force_generate=False):
        if self._cache is None:
            return
        for seq_id, cache_index in self._seq_id_2_cache_index.items():
            if force_generate or self._current_seq_len[cache_index] == self.max_len:
                if self._current_seq_len[cache_index]:
                    self._generate_proof(seq_id, cache_index, self._current_seq_len[cache_index])
                self._current_seq_len[cache_index] = 0

    def _generate_proof(self, seq_id, cache_index, seq_len):
        proof = build_proofs_bytes(self._cache[cache_index, :seq_len], decode_batching_size=self.max_len,
                                   topk=TOPK, skip_prefill=True)[0]
        self.proofs[seq_id].append(proof)


# --- vllm (V0) -----------------------------------------------------------------------------------------------

class SequenceGroupToSample:
    def __init__(self, seq_ids):
        self.seq_ids = seq_ids


class SamplingMetadata:
    def __init__(self, seq_groups, selected_token_indices):
        self.seq_groups = seq_groups
        self.selected_token_indices = selected_token_indices


def _prune_hidden_states(hidden_states, sampling_metadata):
    return hidden_states.index_select(0, sampling_metadata.selected_token_indices)


class LogitsProcessor(torch.nn.Module):
    def forward(self, lm_head, hidden_states, sampling_metadata):
        hidden_states = _prune_hidden_states(hidden_states, sampling_metadata)
        return hidden_states @ lm_head


class AttentionMetadata:
    def __init__(self, slot_mapping, seq_lens, block_tables):
        self.slot_mapping, self.seq_lens, self.block_tables = slot_mapping, seq_lens, block_tables


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(120)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_emb = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_q = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_kv = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_o = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)
        self.logits_processor = LogitsProcessor()

    def forward(self, input_ids, positions, kv_cache, attn_metadata: AttentionMetadata):
        h = self.embed_tokens[input_ids] + self.pos_emb[positions]
        # reshape_and_cache: PAD_SLOT_ID slots write nothing (here: the scratch row MAX_SEQS)
        flat = kv_cache.view(-1, HIDDEN)
        slots = attn_metadata.slot_mapping
        flat[torch.where(slots < 0, torch.full_like(slots, MAX_SEQS * MAX_POS), slots)] = h @ self.w_kv
        kv = kv_cache[attn_metadata.block_tables]                                   # [n, MAX_POS, H]
        scores = (kv @ (h @ self.w_q)[:, :, None]).squeeze(-1) / math.sqrt(HIDDEN)
        valid = torch.arange(MAX_POS, device=h.device)[None, :] < attn_metadata.seq_lens[:, None]
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
        return h + torch.tanh((probs[:, :, None] * kv).sum(1) @ self.w_o)

    def compute_logits(self, hidden_states, sampling_metadata):
        return self.logits_processor(self.lm_head, hidden_states, sampling_metadata)


class CUDAGraphRunner:
    def __init__(self, model, kv_cache):
        self.model, self.kv_cache = model, kv_cache
        self.input_buffers, self.output_buffers, self.graph = {}, {}, None

    def capture(self, input_ids, positions, attn_metadata, memory_pool, device):
        self.input_buffers = {"input_ids": input_ids, "positions": positions,
                              "slot_mapping": attn_metadata.slot_mapping, "seq_lens": attn_metadata.seq_lens,
                              "block_tables": attn_metadata.block_tables}
        self.graph, hidden_states = capture(
            lambda: self.model(input_ids, positions, self.kv_cache, attn_metadata), device=device,
            pool=memory_pool, warmups=2, name=f"decode bs={input_ids.shape[0]}", owner="CUDAGraphRunner (vLLM V0)",
            static=self.input_buffers, state={"kv_cache": self.kv_cache})
        self.output_buffers = {"hidden_states": hidden_states}

    def forward(self, input_ids, positions, attn_metadata, num_real):
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["positions"].copy_(positions)
        # attn_state.prepare_graph_input_buffers
        self.input_buffers["slot_mapping"].copy_(attn_metadata.slot_mapping)
        self.input_buffers["seq_lens"].copy_(attn_metadata.seq_lens)
        self.input_buffers["block_tables"].copy_(attn_metadata.block_tables)
        # the builder wrote dummy values into every padded row: none is left as it was
        return replay(self.graph, self.output_buffers["hidden_states"], real=num_real, size=input_ids.shape[0])


class ModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = LlamaForCausalLM(device)
        self.kv_cache = torch.zeros(MAX_SEQS + 1, MAX_POS, HIDDEN, device=device)   # last row: pad-slot scratch
        self.graph_runners = {}
        if not enforce_eager:
            self.capture_model()

    def capture_model(self):
        max_bs = _BATCH_SIZES_TO_CAPTURE[-1]
        input_tokens = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        input_positions = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        slot_mapping = torch.full((max_bs,), PAD_SLOT_ID, dtype=torch.long, device=self.device)
        seq_lens = torch.ones(max_bs, dtype=torch.long, device=self.device)
        block_tables = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        memory_pool = graph_pool_handle(self.device)
        for bs in reversed(_BATCH_SIZES_TO_CAPTURE):
            runner = CUDAGraphRunner(self.model, self.kv_cache)
            runner.capture(input_tokens[:bs], input_positions[:bs],
                           AttentionMetadata(slot_mapping[:bs], seq_lens[:bs], block_tables[:bs]), memory_pool,
                           self.device)
            self.graph_runners[bs] = runner

    def _prepare_model_input_tensors(self, seq_group_metadata_list, is_prompt):
        tokens, positions, slots, seq_lens, blocks, selected = [], [], [], [], [], []
        for seq in seq_group_metadata_list:
            new = range(len(seq.tokens)) if is_prompt else [len(seq.tokens) - 1]
            for p in new:
                tokens.append(seq.tokens[p])
                positions.append(p)
                slots.append(seq.seq_id * MAX_POS + p)
                seq_lens.append(p + 1)
                blocks.append(seq.seq_id)
            selected.append(len(tokens) - 1)
        batch_size = len(tokens)
        use_cuda_graph = not is_prompt and not self.enforce_eager
        if use_cuda_graph:
            graph_batch_size = next(b for b in _BATCH_SIZES_TO_CAPTURE if b >= batch_size)
            cuda_graph_pad_size = graph_batch_size - batch_size
            tokens += [0] * cuda_graph_pad_size
            positions += [0] * cuda_graph_pad_size
            slots += [PAD_SLOT_ID] * cuda_graph_pad_size
            seq_lens += [1] * cuda_graph_pad_size
            blocks += [0] * cuda_graph_pad_size
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        sampling_metadata = SamplingMetadata([SequenceGroupToSample([s.seq_id]) for s in seq_group_metadata_list],
                                             t(selected))
        return (t(tokens), t(positions), AttentionMetadata(t(slots), t(seq_lens), t(blocks)), sampling_metadata,
                use_cuda_graph, batch_size)

    def execute_model(self, seq_group_metadata_list, is_prompt):
        input_ids, positions, attn_metadata, sampling_metadata, use_cuda_graph, batch_size = \
            self._prepare_model_input_tensors(seq_group_metadata_list, is_prompt)
        if use_cuda_graph:
            hidden_states = self.graph_runners[input_ids.shape[0]].forward(input_ids, positions, attn_metadata,
                                                                           batch_size)
        else:
            hidden_states = self.model(input_ids, positions, self.kv_cache, attn_metadata)
        logits = self.model.compute_logits(hidden_states, sampling_metadata)
        return logits.argmax(-1).tolist()                                          # greedy sampler


class Sequence:
    def __init__(self, seq_id, prompt_token_ids, max_tokens):
        self.seq_id, self.tokens, self.max_tokens = seq_id, list(prompt_token_ids), max_tokens
        self.prompt_len = len(prompt_token_ids)

    @property
    def output_token_ids(self):
        return self.tokens[self.prompt_len:]


class LLM:
    def __init__(self, device, enforce_eager):
        self.model_runner = ModelRunner(device, enforce_eager)

    def generate(self, prompts, max_tokens):
        seqs = [Sequence(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        running, is_prompt = list(seqs), True
        while running:
            for seq, tok in zip(running, self.model_runner.execute_model(running, is_prompt)):
                seq.tokens.append(tok)
            running = [s for s in running if len(s.output_token_ids) < s.max_tokens]
            is_prompt = False
        return seqs


# --- src/zeroband/inference.py -------------------------------------------------------------------------------

def get_parquet_table(generated_tokens, proofs):
    """The rollouts' output tokens and their proofs (``proofs_list.append(next(proof_iter) if len(output.token_ids)
    > 1 else b"")``), as tensors."""
    output_tokens_list, proofs_list = [], []
    proof_iter = iter(proofs)
    for output in generated_tokens:
        output_tokens_list.append(torch.tensor(output.output_token_ids, dtype=torch.float64))
        proofs_list.append(next(proof_iter) if len(output.output_token_ids) > 1 else torch.zeros(0))
    return output_tokens_list + proofs_list


def inference(variant, device, enforce_eager, prompts, max_tokens):
    llm = LLM(device, enforce_eager)
    model = llm.model_runner.model
    toploc_cache = TopLocCache(max_seqs=MAX_SEQS, max_len=TOPLOC_MAX_LEN, hidden_size=HIDDEN)

    def logits_processor_hook(module, input):
        if variant == "fix":
            hidden_states, sampling_metadata = input[1], input[2]
            assert isinstance(hidden_states, torch.Tensor)
            assert isinstance(sampling_metadata, SamplingMetadata)
            # This check is true only for prefills
            if max(sampling_metadata.selected_token_indices) > len(sampling_metadata.seq_groups):
                return
            # This pruning is required when cuda graph padding is enabled.
            hidden_states = _prune_hidden_states(hidden_states, sampling_metadata)
            if len(sampling_metadata.seq_groups) != hidden_states.shape[0]:
                raise ValueError(f"Lengths dont match: {len(sampling_metadata.seq_groups)} {hidden_states.shape}")
            index = [i.seq_ids[0] for i in sampling_metadata.seq_groups]
            toploc_cache.add(index, hidden_states)
            return
        assert isinstance(input[1], torch.Tensor)
        assert isinstance(input[2], SamplingMetadata)
        # If the lengths dont match its not a decode step
        if len(input[2].seq_groups) != input[1].shape[0]:
            return
        index = [i.seq_ids[0] for i in input[2].seq_groups]
        toploc_cache.add(index, input[1])

    model.logits_processor.register_forward_pre_hook(logits_processor_hook)

    generated_tokens = llm.generate(prompts, max_tokens)
    toploc_cache.maybe_generate_proofs_in_background(force_generate=True)
    proofs = [torch.cat(p, dim=1) for _, p in sorted(toploc_cache.proofs.items(), key=lambda x: x[0])]
    toploc_cache.reset_cache()
    return get_parquet_table(generated_tokens, proofs)


def run(variant: str, device: str = "cpu"):
    gen = generator(1200)
    prompt_lens = [3, 4, 3, 5]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    # the batch decodes 4 sequences (a captured size), then 3 (padded to 4) for two steps, then 2, then 1
    max_tokens = [8, 6, 5, 3]
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: inference(variant, device, False, prompts, max_tokens),
                   lambda: inference(variant, device, True, prompts, max_tokens))
