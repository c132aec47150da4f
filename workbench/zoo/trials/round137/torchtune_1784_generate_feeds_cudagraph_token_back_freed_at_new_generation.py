"""torchtune's ``generate`` recipe with a quantized model compiles ``generate_next_token`` with
``torch.compile(mode="max-autotune")`` (cudagraph trees) and feeds the token each decode step returns straight back
in as the next step's ``x``. Every call of the compiled function is a new torch.compile invocation, so in inference
the tree may start a new generation at each call; when it leaves the recording of the decode graph it deallocates the
live outputs of the path, among them the very token the caller is passing in, and copying that token into the graph's
static input raises "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run". The fix
passes ``x=tokens.clone()``: the input is then a tensor the tree does not own, and the compiled generation equals
the eager one.

Upstream: https://github.com/meta-pytorch/torchtune/pull/1784 ("Fix quantization with generate", repository
pytorch/torchtune, now meta-pytorch/torchtune, by Salman Mohammadi; squash-merged 2024-10-09 as commit
54673b77a3b2d0d8956c42510585c6ea0d979f29). Read, in a mirror of the repository: the whole diff of 54673b77a
(``recipes/generate.py``: checkpointer and QAT checks, ``load_state_dict(..., assign=True)`` for quantized models;
``torchtune/generation/_generation.py``: ``x=tokens`` -> ``x=tokens.clone()`` in ``generate``), two commits of the same
author and day in the mirror, on a branch that the merge squashed (likely the PR's: "fixing cudagraphs", b9bb99cd7
with the one-line change, be9a6aab7 raising the recipe's warm-up to 8 tokens, which the merged diff does not
contain); at the parent 54673b77a^ ``_generation.py`` whole
(``multinomial_sample_one``, ``sample``, ``generate_next_token``, ``generate``), ``recipes/generate.py``
(``InferenceRecipe.generate``: the ``torch.compile(generation.generate_next_token, mode="max-autotune",
fullgraph=True)`` under ``@torch.inference_mode()``, the warm-up ``generate`` of 2 tokens, ``reset_caches``),
``modules/kv_cache.py`` (``KVCache``: ``cache_pos``, ``reset``, ``size``, ``update``), and the cache and forward
signatures of ``modules/attention.py`` and ``modules/transformer.py``. The cudagraph-trees code was read in the
installed torch 2.13 (``torch/_inductor/cudagraph_trees.py``: ``CUDAGraphTreeManager.run``/``_run``,
``try_end_curr_warmup``, ``try_end_curr_recording``, ``try_end_curr_execution``, ``can_start_new_generation``,
``in_new_torch_compile_invocation``, ``dealloc_current_path_weakrefs``, ``format_dealloc_msg``, ``record_function``,
``execute_node``, ``run_eager``; ``CUDAGraphNode.__init__`` (record, then one ``graph.replay()``),
``run_first_inputs``, ``run``, ``_copy_inputs_and_remove_from_src``; ``torch/_dynamo/mutation_guard.py``
``install_generation_tagging_init``, which ``OptimizeContext`` runs on entering every compiled call and which ends
with ``GenerationTracker.generation += 1``).
Not read: the PR's description and review beyond an excerpt of its test log (a quantized Llama-3.1-8B
``tune run generate`` that completes); the torch of October 2024 (2.4/2.5): that its trees behaved as 2.13's here is
an assumption, supported by the error quoted below (August 2024); torchtune's RoPE, RMSNorm, SDPA/flex dispatch
and the quantizers (``Int8DynActInt4WeightQuantizer``).
Symptom: quoted by Matthias Reso in the earlier, unmerged https://github.com/meta-pytorch/torchtune/pull/1371, which
made the same change ("without it we're running into this error"): "RuntimeError: Error: accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run. Stack trace: ... in multinomial_sample_one return
torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int). To prevent overwriting, clone the tensor outside
of torch.compile() or call torch.compiler.cudagraph_mark_step_begin() before each model invocation." Generation of
quantized models (the only path that compiles) failed; unquantized generation runs eagerly and was unaffected.
Mechanism: the recipe's warm-up ``generate`` (2 tokens) makes one compiled call: the tree's warm-up (an eager run in
the graph pool). The real ``generate`` then decodes: its first compiled call starts a new generation (the warm-up's
outputs are dead by then) and records the decode graph, returning the recording outputs ``tokens`` and ``logits``,
which live in the graph pool. The loop appends ``tokens`` to ``generated_tokens`` and passes the same tensor as
``x`` of the next call. That call bumps ``GenerationTracker.generation`` on entry, so ``try_end_curr_recording``
finds ``can_start_new_generation()`` (a new invocation, no pending backward in inference) and calls
``dealloc_current_path_weakrefs``: every live output of the path, ``x`` included, is freed and its storage poisoned.
The tree then replays the recorded root: ``_copy_inputs_and_remove_from_src`` copies the new inputs into the
graph's static inputs and reads the poisoned ``x``, which raises. Eagerly there is no tree and nothing is freed.
Doctor: dangling-reference, at ``generate``. The read that fails is of a tensor whose memory its owner (the tree's
pool) released at the generation boundary; ``generate`` is where the defect is decided and what the fix changes:
it hands a cudagraph output that the next compiled call will release back to that call as its input, instead of a
copy the caller owns. (The tree's ``dealloc_current_path_weakrefs`` is where the memory is released; it does so by
design at every new generation.)
Fix (upstream): ``x=tokens.clone()`` in the decode loop of ``generate``. The tree still frees ``tokens`` and
``logits`` of the previous step at the boundary (nobody reads them after), and the clone it copies in is intact.
Modelled: ``multinomial_sample_one``, ``sample``, ``generate_next_token``, ``generate`` (bug / fix as in the diff;
its masks, positions, ``q`` draws, prefill and decode loop as at 54673b77a^ without stop tokens),
``InferenceRecipe.generate`` (compile, warm-up generate of 2 tokens, ``reset_caches``, generate); ``KVCache``
(``cache_pos``, ``reset``, ``size``, ``update``), ``MultiHeadAttention``, ``TransformerDecoder`` (``setup_caches``,
``caches_are_enabled``, ``reset_caches``, ``decoder_max_cache_seq_len``, ``tok_embeddings.num_embeddings``); of the
trees: ``GenerationTracker``/``MarkStepBox``, ``install_generation_tagging_init``, ``CUDAGraphTreeManager`` (``run``,
``_run``, the three ``try_end_curr_*``, ``can_start_new_generation``, ``in_new_torch_compile_invocation``,
``dealloc_current_path_weakrefs``, ``clear_current_path_state_and_set_to_none``, ``record_function``,
``execute_node``, ``run_eager``, ``format_dealloc_msg``), ``CUDAWarmupNode.run``, ``CUDAGraphNode`` (record then
replay once, ``run_first_inputs``, ``run``, ``_allocate_and_copy_recording_inputs``,
``_copy_inputs_and_remove_from_src``).
Stand-ins: ``OptimizedFunction`` is ``torch.compile(generate_next_token, mode="max-autotune", fullgraph=True)``: no
Dynamo or Inductor, the Python function is captured as it is, with the model's buffers and parameters as static
inputs and ``input_pos``, ``x``, ``q``, ``mask`` as the non-static ones. The poison the tree installs in C++
(``_set_storage_access_error_msg``, ``_free_And_Remove_DeleterFn``, which make any later data access of the freed
tensor raise ``format_dealloc_msg``) is a table of the handed-out tensors it freed, checked where the tree reads an
input (``_check_storage_access``): the tree's recording outputs own pool memory the graph keeps writing, and this
torch (a CPU build) has neither function; the freed memory is not reused here. The model: a two-layer decoder
(width 8, 2 heads, vocabulary 16) in float64 with a learned position table instead of RoPE, no norms, plain masked
softmax attention instead of SDPA, random weights standing for the 8da4w-quantized Llama; ``q`` is drawn on the CPU
from a seeded generator and moved to the device (upstream: the global RNG); ``torch.no_grad()`` for the recipe's
``@torch.inference_mode()`` (the tree's mode is inference either way; a first capture under inference mode can
leave inference tensors in the generator's graph state on some torch versions: pytorch#172706, known here by its
title only); the stack traces in the poison message are the innermost (``tokens``) and outermost (``logits``)
frames at 54673b77a^, where FX keeps the whole stack; no stop
tokens (the recipe passes the tokenizer's; the prompt has no padding, as upstream's single prompt).
Workload: one prompt of 5 tokens; the recipe's warm-up generate of 2 tokens, then a generate of 6 tokens (5 compiled
decode calls). Outputs: the generated tokens and their logits. Eager = the same recipe with the plain function.
Measured: bug: misbehaves (raised RuntimeError: Error: accessing tensor output of CUDAGraphs that has been
overwritten by a subsequent run. Stack trace: File "torchtune/generation/_generation.py", line 15, in
multinomial_sample_one ...): the second decode call of the real generate (the first after the recording). Fix:
equals eager (max |graph - eager| = 0): recording, then four replays. About 1.3 s per variant on the CPU.
"""
from __future__ import annotations

import enum
import weakref
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/meta-pytorch/torchtune/pull/1784"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "generate"
SYMPTOM = ("generation with a quantized (torch.compile max-autotune) model fails on its second decode step: the "
           "token the compiled step returned, fed back as x, was freed by cudagraph trees at the new generation "
           "('accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run')")

VOCAB, EMBED_DIM, NUM_HEADS, NUM_LAYERS = 16, 8, 2, 2
HEAD_DIM = EMBED_DIM // NUM_HEADS
PROMPT = [3, 7, 1, 12, 5]
MAX_NEW_TOKENS, TEMPERATURE, TOP_K = 6, 0.6, 8
DTYPE = torch.float64

_variant = "bug"


# --- torchtune/modules: KVCache, attention, decoder (reduced) ---------------------------------------------------------

class KVCache:
    def __init__(self, batch_size, max_seq_len, num_heads, head_dim, dtype, device):
        cache_shape = (batch_size, num_heads, max_seq_len, head_dim)
        self.k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        self.cache_pos = torch.arange(0, cache_shape[2], device=device)

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cache_pos -= self.size

    @property
    def size(self) -> int:
        return self.cache_pos[0].item()

    def update(self, k_val, v_val):
        seq_len = k_val.shape[2]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, self.cache_pos[:seq_len]] = k_val
        v_out[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos += seq_len
        return k_out, v_out


class MultiHeadAttention:
    def __init__(self, gen, device):
        w = lambda: randn(EMBED_DIM, EMBED_DIM, gen=gen, device=device, scale=EMBED_DIM ** -0.5).to(DTYPE)
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = w(), w(), w(), w()
        self.kv_cache: Optional[KVCache] = None

    def setup_cache(self, batch_size, dtype, max_seq_len, device):
        if self.kv_cache is None:
            self.kv_cache = KVCache(batch_size, max_seq_len, NUM_HEADS, HEAD_DIM, dtype, device)

    def forward(self, x, *, mask):
        b, s, _ = x.shape
        heads = lambda t: t.view(b, s, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        q, k, v = heads(x @ self.q_proj), heads(x @ self.k_proj), heads(x @ self.v_proj)
        k, v = self.kv_cache.update(k, v)
        scores = (q @ k.transpose(-1, -2)) * HEAD_DIM ** -0.5                # [b, h, s, max_seq_len]
        scores = scores.masked_fill(~mask[:, None, :, :], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, EMBED_DIM) @ self.output_proj


class TokenEmbedding:
    def __init__(self, gen, device):
        self.weight = randn(VOCAB, EMBED_DIM, gen=gen, device=device).to(DTYPE)
        self.num_embeddings = VOCAB

    def __call__(self, tokens):
        return self.weight[tokens]


class TransformerDecoder:
    def __init__(self, device):
        gen = generator(1784)
        self.tok_embeddings = TokenEmbedding(gen, device)
        self.pos_embeddings = randn(64, EMBED_DIM, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [MultiHeadAttention(gen, device) for _ in range(NUM_LAYERS)]
        self.mlps = [randn(EMBED_DIM, EMBED_DIM, gen=gen, device=device, scale=0.4).to(DTYPE)
                     for _ in range(NUM_LAYERS)]
        self.output = randn(EMBED_DIM, VOCAB, gen=gen, device=device).to(DTYPE)
        self.decoder_max_cache_seq_len = None
        self.device = device

    def setup_caches(self, batch_size, dtype, *, decoder_max_seq_len):
        self.decoder_max_cache_seq_len = decoder_max_seq_len
        for layer in self.layers:
            layer.setup_cache(batch_size, dtype, decoder_max_seq_len, self.device)

    def caches_are_enabled(self) -> bool:
        return self.decoder_max_cache_seq_len is not None

    def reset_caches(self):
        for layer in self.layers:
            layer.kv_cache.reset()

    def cache_tensors(self):
        return {f"layers.{i}.kv_cache.{n}": getattr(layer.kv_cache, n)
                for i, layer in enumerate(self.layers) for n in ("k_cache", "v_cache", "cache_pos")}

    def __call__(self, tokens, *, mask, input_pos):
        h = self.tok_embeddings(tokens) + self.pos_embeddings[input_pos]
        for attn, mlp in zip(self.layers, self.mlps):
            h = h + attn.forward(h, mask=mask)
            h = h + torch.tanh(h @ mlp)
        return h @ self.output                                                # [b, s, vocab]


# --- torchtune/generation/_generation.py ------------------------------------------------------------------------------

def multinomial_sample_one(probs, q):
    """Samples from a multinomial distribution."""
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)


def sample(logits, *, temperature=1.0, top_k=None, q=None):
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return multinomial_sample_one(probs, q)


def generate_next_token(model, input_pos, x, q, *, mask=None, temperature=1.0, top_k=None):
    logits = model(x, input_pos=input_pos, mask=mask)
    return (sample(logits[:, -1].clone(), temperature=temperature, top_k=top_k, q=q), logits)


def _draw_q(bsz, model, device, rng):
    """``torch.empty((bsz, vocab)).exponential_(1, generator=rng)``, drawn on the CPU (stand-in) and moved."""
    q = torch.empty((bsz, model.tok_embeddings.num_embeddings), dtype=DTYPE).exponential_(1, generator=rng)
    return q.to(device)


def generate(model, prompt, *, max_generated_tokens, pad_id=0, temperature=1.0, top_k=None, rng=None,
             custom_generate_next_token=None):
    prompt = prompt.view(1, -1) if prompt.ndim == 1 else prompt
    if custom_generate_next_token is None:
        custom_generate_next_token = generate_next_token

    bsz, prompt_length = prompt.size()
    total_response_length = prompt_length + max_generated_tokens
    generated_tokens = prompt.clone()
    incremental_decoding = model.caches_are_enabled()
    max_seq_len = total_response_length if not incremental_decoding else model.decoder_max_cache_seq_len

    padding_masks = generated_tokens != pad_id
    assert padding_masks.all(), "stand-in: a single prompt without padding, as the recipe's"
    masks = torch.tril(torch.ones(total_response_length, max_seq_len, dtype=torch.bool,
                                  device=prompt.device)).unsqueeze(0)
    input_pos = torch.arange(0, total_response_length, device=generated_tokens.device).unsqueeze(0)

    curr_masks = masks[:, :prompt_length] if incremental_decoding else masks[:, :prompt_length, :prompt_length]

    q = _draw_q(bsz, model, prompt.device, rng)
    tokens, generated_logits = generate_next_token(                         # prefill: never compiled
        model, input_pos=input_pos[:, :prompt_length].squeeze(), mask=curr_masks, x=prompt,
        temperature=temperature, top_k=top_k, q=q)
    generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
    curr_pos = prompt_length

    for _ in range(max_generated_tokens - 1):
        if incremental_decoding:
            curr_input_pos = input_pos[:, curr_pos]
            curr_masks = masks[:, curr_pos, None, :]
        else:
            tokens = generated_tokens.clone()
            curr_input_pos = input_pos[:, : curr_pos + 1]
            curr_masks = masks[:, : curr_pos + 1, : curr_pos + 1]

        q = _draw_q(bsz, model, prompt.device, rng)
        tokens, logits = custom_generate_next_token(
            model,
            input_pos=curr_input_pos,
            x=tokens if _variant == "bug" else tokens.clone(),                # the fix: x=tokens.clone()
            mask=curr_masks,
            temperature=temperature,
            top_k=top_k,
            q=q,
        )
        generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
        curr_pos += 1
        generated_logits = torch.cat([generated_logits, logits], dim=1) if incremental_decoding else logits

    return generated_tokens, generated_logits


# --- torch/_dynamo + torch/_inductor/cudagraph_trees.py (reduced) ----------------------------------------------------

class GenerationTracker:
    generation = 0


class MarkStepBox:
    mark_step_counter = 0


def install_generation_tagging_init():
    """Run by dynamo's ``OptimizeContext`` on entering every compiled call; ends with ``generation += 1``."""
    GenerationTracker.generation += 1


_storage_access_errors = WeakIdKeyDictionary()      # stand-in for the C++ poison (see Stand-ins)


def _set_storage_access_error_msg(t, msg):
    _storage_access_errors[t] = msg


def _check_storage_access(t):
    """Any data access of a tensor the tree freed raises its message (C++ in torch)."""
    msg = _storage_access_errors.get(t) if isinstance(t, torch.Tensor) else None
    if msg is not None:
        raise RuntimeError(msg)


class ExecutionState(enum.Enum):
    NONE, WARMUP, RECORDING, EXECUTION = range(4)


class CUDAWarmupNode:
    def __init__(self, wrapped_function, parent, stack_traces):
        self.wrapped_function, self.parent, self.stack_traces = wrapped_function, parent, stack_traces
        self.tensor_weakrefs = []

    def all_outputs_are_dead(self):
        return all(ref() is None for ref in self.tensor_weakrefs)

    def run(self, new_inputs):
        for t in new_inputs:
            _check_storage_access(t)
        with events.warmup(real=True):                   # an eager run in the graph pool; its results are served
            out = self.wrapped_function(*new_inputs)
        self.tensor_weakrefs = [weakref.ref(t) for t in out]
        return out


class CUDAGraphNode:
    def __init__(self, wrapped_function, parent, inputs, pool, device, stack_traces, persistent):
        self.wrapped_function, self.parent, self.stack_traces = wrapped_function, parent, stack_traces
        self.children: dict[str, list] = {}
        self.tensor_weakrefs = []
        recording_inputs = self._allocate_and_copy_recording_inputs(inputs)
        self.reconstructed_inputs = recording_inputs
        names = ("input_pos", "x", "q", "mask")
        self.graph, self.static_outputs = capture(
            lambda: wrapped_function(*recording_inputs), device=device, pool=pool, warmups=0,
            name="generate_next_token", static=dict(zip(names, recording_inputs)), state=persistent,
            owner="CUDAGraphTreeManager")
        self.recording_outputs = replay(self.graph, self.static_outputs)     # self.graph.replay() in __init__

    def _allocate_and_copy_recording_inputs(self, inputs):
        recording_inputs = []
        for inp in inputs:
            _check_storage_access(inp)
            static = torch.empty_like(inp)
            static.copy_(inp)
            recording_inputs.append(static)
        return recording_inputs

    def _path_from_root(self):
        node, path = self, []
        while node is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _track(self, outputs):
        self.tensor_weakrefs = [weakref.ref(t) for t in outputs]
        return outputs

    def all_outputs_are_dead(self):
        return all(ref() is None for ref in self.tensor_weakrefs)

    def run_first_inputs(self):
        outputs, self.recording_outputs = self.recording_outputs, None
        return self._track(outputs)

    def _copy_inputs_and_remove_from_src(self, dsts, srcs):
        for dst, src in zip(dsts, srcs):
            _check_storage_access(src)
            dst.copy_(src)
        srcs.clear()

    def run(self, new_inputs):
        self._copy_inputs_and_remove_from_src(self.reconstructed_inputs, new_inputs)
        return self._track(replay(self.graph, self.static_outputs))


class CUDAGraphTreeManager:
    def __init__(self, device):
        self.device = device
        self.cuda_graphs_thread_pool = graph_pool_handle(device)
        self.roots: dict[str, list] = {}
        self.warmed_up_functions: set[str] = set()
        self.ids_to_funcs: dict = {}
        self.persistent: dict = {}
        self._current_node = None
        self.path_state = ExecutionState.NONE
        self.current_gen = -1
        self.running_forwards_with_pending_backwards = False     # inference: stays False

    @property
    def current_node(self):
        return self._current_node

    @current_node.setter
    def current_node(self, value):
        self._current_node = value
        if value is None:
            self.path_state = ExecutionState.NONE

    in_warmup = property(lambda self: self.path_state == ExecutionState.WARMUP)
    in_recording = property(lambda self: self.path_state == ExecutionState.RECORDING)

    @staticmethod
    def get_curr_generation():
        return MarkStepBox.mark_step_counter if MarkStepBox.mark_step_counter != 0 else GenerationTracker.generation

    def update_generation(self):
        self.current_gen = self.get_curr_generation()

    def in_new_torch_compile_invocation(self):
        return self.current_gen != self.get_curr_generation()

    def can_start_new_generation(self):
        if not self.in_new_torch_compile_invocation():
            return False
        if MarkStepBox.mark_step_counter != 0:
            return True
        return not self.running_forwards_with_pending_backwards

    @staticmethod
    def format_dealloc_msg(stack_trace):
        return ("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. "
                f"Stack trace: {stack_trace}. To prevent overwriting, clone the tensor outside of torch.compile() "
                "or call torch.compiler.cudagraph_mark_step_begin() before each model invocation.")

    def dealloc_current_path_weakrefs(self):
        nodes = (self.current_node._path_from_root() if isinstance(self.current_node, CUDAGraphNode)
                 else [self.current_node])
        for node in nodes:
            for ref, stack_trace in zip(node.tensor_weakrefs, node.stack_traces):
                ten = ref()
                if ten is not None:                            # a live output: freed, its storage poisoned
                    _set_storage_access_error_msg(ten, self.format_dealloc_msg(stack_trace))
            node.tensor_weakrefs = []

    def clear_current_path_state_and_set_to_none(self):
        self.current_node = None

    def try_end_curr_warmup(self, function_id):
        if self.can_start_new_generation():
            self.dealloc_current_path_weakrefs()
            self.current_node = None
            return
        if self.current_node.all_outputs_are_dead():
            self.current_node = None

    def try_end_curr_recording(self, function_id):
        if self.can_start_new_generation():
            self.dealloc_current_path_weakrefs()
            self.clear_current_path_state_and_set_to_none()
            return
        if self.current_node.all_outputs_are_dead():
            self.clear_current_path_state_and_set_to_none()

    def try_end_curr_execution(self):
        if self.current_node is None:
            return
        if self.can_start_new_generation() or self.current_node.all_outputs_are_dead():
            self.clear_current_path_state_and_set_to_none()

    def run(self, new_inputs, function_id):
        return self._run(new_inputs, function_id)        # inference: no pending backwards follow

    def _run(self, new_inputs, function_id):
        if self.in_recording:
            self.try_end_curr_recording(function_id)
        if self.in_warmup:
            self.try_end_curr_warmup(function_id)
        if function_id not in self.warmed_up_functions or self.in_warmup:
            return self.run_eager(new_inputs, function_id)
        child_nodes = self.roots if self.current_node is None else self.current_node.children
        if not self.in_recording:
            for child in child_nodes.get(function_id, []):
                return self.execute_node(child, new_inputs)     # check_invariants: same shapes every step
            if self.current_node is not None and function_id in self.roots:
                self.try_end_curr_execution()
                if self.current_node is None:
                    return self.run(new_inputs, function_id)
            self.try_end_curr_execution()
        return self.record_function(new_inputs, function_id)

    def record_function(self, new_inputs, function_id):
        wrapped, stack_traces = self.ids_to_funcs[function_id]
        node = CUDAGraphNode(wrapped, self.current_node, new_inputs, self.cuda_graphs_thread_pool, self.device,
                             stack_traces, self.persistent)
        if self.current_node is None:
            self.roots.setdefault(function_id, []).append(node)
        else:
            self.current_node.children.setdefault(function_id, []).append(node)
        self.current_node = node
        self.path_state = ExecutionState.RECORDING
        self.update_generation()
        return node.run_first_inputs()

    def execute_node(self, node, new_inputs):
        self.current_node = node
        self.path_state = ExecutionState.EXECUTION
        self.update_generation()
        return node.run(list(new_inputs))

    def run_eager(self, new_inputs, function_id):
        self.warmed_up_functions.add(function_id)
        wrapped, stack_traces = self.ids_to_funcs[function_id]
        node = CUDAWarmupNode(wrapped, self.current_node, stack_traces)
        self.current_node = node
        self.path_state = ExecutionState.WARMUP
        self.update_generation()
        return node.run(new_inputs)


class OptimizedFunction:
    """``torch.compile(generate_next_token, mode="max-autotune", fullgraph=True)`` on the tree (stand-in)."""

    STACK_TRACES = (
        'File "torchtune/generation/_generation.py", line 15, in multinomial_sample_one\n'
        "    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)",
        'File "torchtune/generation/_generation.py", line 102, in generate_next_token\n'
        "    logits = model(x, input_pos=input_pos, mask=mask)",
    )

    def __init__(self, fn, manager):
        self.fn, self.manager, self.function_id = fn, manager, fn.__name__

    def __call__(self, model, *, input_pos, x, q, mask=None, temperature=1.0, top_k=None):
        install_generation_tagging_init()
        if self.function_id not in self.manager.ids_to_funcs:        # compiled once: constants baked in
            wrapped = lambda input_pos, x, q, mask: tuple(self.fn(model, input_pos, x, q, mask=mask,
                                                                  temperature=temperature, top_k=top_k))
            self.manager.ids_to_funcs[self.function_id] = (wrapped, self.STACK_TRACES)
            self.manager.persistent = model.cache_tensors()
        return self.manager.run([input_pos, x, q, mask], self.function_id)


# --- recipes/generate.py (reduced) ------------------------------------------------------------------------------------

class InferenceRecipe:
    def __init__(self, device, compile_with_cudagraphs: bool):
        self._device = device
        self._quantization_mode = "8da4w"              # Int8DynActInt4WeightQuantizer: generation compiles
        self._compile = compile_with_cudagraphs
        self._model = TransformerDecoder(device)
        self._rng = generator(1234)                    # seed: 1234

    @torch.no_grad()                                   # upstream: @torch.inference_mode()
    def generate(self):
        prompt = torch.tensor(PROMPT, dtype=torch.int).to(self._device)
        custom_generate_next_token = None
        self._model.setup_caches(batch_size=1, dtype=DTYPE, decoder_max_seq_len=prompt.numel() + MAX_NEW_TOKENS)
        if self._quantization_mode is not None:
            custom_generate_next_token = (OptimizedFunction(generate_next_token, CUDAGraphTreeManager(self._device))
                                          if self._compile else generate_next_token)
            _ = generate(self._model, prompt, max_generated_tokens=2, temperature=TEMPERATURE, top_k=TOP_K,
                         rng=self._rng, custom_generate_next_token=custom_generate_next_token)
            self._model.reset_caches()
        generated_tokens, generated_logits = generate(
            self._model, prompt, max_generated_tokens=MAX_NEW_TOKENS, pad_id=0, temperature=TEMPERATURE,
            top_k=TOP_K, rng=self._rng, custom_generate_next_token=custom_generate_next_token)
        return [generated_tokens, generated_logits]


def run(variant: str, device: str = "cpu"):
    global _variant

    def eager():
        return [t.clone() for t in InferenceRecipe(device, compile_with_cudagraphs=False).generate()]

    def served():
        GenerationTracker.generation, MarkStepBox.mark_step_counter = 0, 0
        return [t.clone() for t in InferenceRecipe(device, compile_with_cudagraphs=True).generate()]

    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
    finally:
        _variant = "bug"
