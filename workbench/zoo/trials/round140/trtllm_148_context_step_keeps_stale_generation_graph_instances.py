"""TensorRT-LLM's Python runtime (``GenerationSession`` with ``cuda_graph_mode=True``) captures, during every decoding
step, the TensorRT enqueue of the *next* generation step into one of two ping-pong graph instances
(``_Runtime.cuda_graph_instances[(step + 1) % 2]``), and at each step launches ``instances[step % 2]`` when it is set,
else runs the execution context eagerly. Step 0 of a ``decode()`` is the context phase, so ``handle_per_step`` meant to
drop both instances there ("context mode, clean cuda graph instances"), but it assigned ``self.cuda_graph_instances``
on the session instead of ``self.runtime.cuda_graph_instances``. The instances captured in the previous ``decode()``
survive: at step 0 of every later ``decode()`` the ``instance_idx = 0`` check finds the graph of the previous
decode's last even generation step and launches it instead of running the context phase. That graph is bound to
the previous decode's tensors (its new tokens, position and last-token ids, cache indirection, and the logits and KV
buffers that ``setup()`` has since reallocated), all released by then. TensorRT-LLM #148 assigns the runtime's list.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/148 ("Update TensorRT-LLM", repository NVIDIA/TensorRT-LLM,
author Kaiyu Xie (kaiyux) with Shixiaowei02; merged into main on 2023-10-27 as commit
d8b408e6dcc1d45982a8b94399cd74b78f80befa, one of the weekly bulk updates: 201 files). The fix is one line of its
``tensorrt_llm/runtime/generation.py`` hunk. The stored corpus lists the PR as merged and gives only its title. Read,
in a mirror of the fork mathemakitten/TensorRT-LLM, which keeps main's history to mid-2024 (#1966):
``git log -G'cuda_graph_instances = \\[None'`` on ``generation.py`` (the wrong assignment is in the initial public
commit 23bc5b7c of 2023-09-20 and in 027cd518; it was fixed in d8b408e6); the whole ``generation.py`` diff of
d8b408e6; and at d8b408e6^: ``_update_cuda_graph_instance``,
``_Runtime`` (``__prepare``: one optimization profile makes ``ctx_context`` ``context_1``; ``_set_shape``,
``_set_buffer``, ``_run``), ``GenerationSession.setup``, ``__setup_decoder``, ``_get_context_shape_buffer``,
``_get_next_step_shape_buffer``, ``_prepare_context_inputs``, ``_prepare_generation_inputs``, ``finalize_decoder``,
``handle_per_step``, ``decode_regular`` and ``decode``. Also read: ``benchmarks/python/gpt_benchmark.py`` and
``benchmark.py`` at d8b408e6^ (``--enable_cuda_graph`` passes ``cuda_graph_mode``; ``run()`` calls ``setup()`` and then
``decode()`` with the same inputs on every warm-up and measured iteration). At that commit, only the benchmark turns
graphs on.
Not read: the PR's description and discussion (none in the corpus), the rest of the 201-file diff, the C++
``GptSession`` CUDA-graph executor, the GPT attention plugin and ``DynamicDecodeOp`` sources (their behaviour here is
inferred from how ``generation.py`` calls them), TensorRT's capture of ``execute_async_v3``, and
``cudaGraphExecUpdate``'s exact rules. No user report was found (searched the issues corpus). The symptom below is
what the code before the fix does, read line by line; it is not quoted from upstream.
Symptom: on the second and later ``decode()`` of a session built with ``cuda_graph_mode=True`` (every iteration of
``gpt_benchmark.py --enable_cuda_graph`` after the first), step 0 skips the context phase. It launches a stale
generation graph over released buffers. The prompt's KV cache is never written and the first token comes from that
stale step. On CUDA this gives wrong tokens, or a fault once the memory is returned. No error is raised before that.
Mechanism: ``decode()`` #1: step 0 runs ``ctx_context`` eagerly (both instances are None), and each step ``s`` then
binds ``context_{(s+1)%2}`` to step ``s+1``'s tensors and captures it into ``instances[(s+1)%2]``
(``cudaGraphInstantiate``, later ``_update_cuda_graph_instance``). Steps 1.. launch them. ``decode()`` #2:
``setup()`` replaces ``self.buffer`` (logits, KV caches), ``__setup_decoder`` replaces ``new_tokens`` and the other
decoder buffers, the ping-pong cache indirections are new locals, and the previous ``next_step_buffer`` (position and
last-token ids) died with ``decode_regular``'s frame. At step 0 the context inputs are bound to ``ctx_context``.
The cleanup then writes the session's attribute, so ``self.runtime.cuda_graph_instances[0]`` still holds decode #1's
step-4 graph, captured from ``context_1``. The launch branch takes it. The stale graph reads and writes the released
tensors, and the context phase never runs. With the fix, step 0 finds no instance, runs the context eagerly and
every graph of decode #2 is captured anew against its own tensors.
Doctor: dangling-reference, at ``handle_per_step``. The graph launched at step 0 reads memory whose owners released
it: the tensors bound when it was captured belonged to the previous ``decode()`` and were dropped by ``setup()``,
``__setup_decoder`` and the end of ``decode_regular``. ``handle_per_step`` decides this and the fix changes it: at the
context step it must drop the graph instances bound to the previous decode's buffers, and it chooses
``instances[step % 2]`` over the eager context run. (The replayed work is also a generation step where the context
phase was due, so the graph does other work than the eager step would. That is a consequence of the same stale
instance. Capture chose nothing wrong: the graph was right for the step it was captured for.)
Fix (upstream): ``self.cuda_graph_instances = [None for _ in range(2)]`` -> ``self.runtime.cuda_graph_instances =
[None for _ in range(2)]`` in ``handle_per_step``'s ``step == 0`` branch.
Modelled: ``_Runtime`` (``cuda_graph_instances``, ``context_0``, ``context_1``, ``ctx_context`` = ``context_1`` for
one profile, ``_set_shape``, ``_set_buffer`` with its zero-filled fallback, ``_run``), ``_update_cuda_graph_instance``,
``GenerationSession`` (``setup``, ``__setup_decoder``, ``_get_context_shape_buffer``,
``_get_next_step_shape_buffer``, ``_prepare_context_inputs``, ``_prepare_generation_inputs``, ``handle_per_step`` with
its ping-pong contexts, cache indirections and the capture of the next step, ``decode_regular``, ``decode``,
``finalize_decoder``), ``SamplingConfig`` and ``gpt_benchmark``'s ``run`` loop. The layout is the GPT attention plugin
without removed input padding, with a contiguous (not paged) KV cache, beam width 1 and learned absolute positions.
Stand-ins: the TensorRT engine is a two-layer, one-head GPT (width 16, vocab 32) in float64. Its
``IExecutionContext`` keeps shapes and *weak* references to the bound tensors, because TensorRT keeps raw addresses
and does not keep a tensor alive. ``execute_async_v3`` reads the bound tensors and writes ``logits`` and the KV cache
in place. The attention plugin branches on the host tensor ``host_request_types`` and bounds the generation kernel
with ``host_past_key_value_lengths``, both read at enqueue and so frozen into a capture; generation writes the new
token's K/V at ``sequence_length - 1`` and reads past tokens through ``cache_indirection``. These plugin details are
guesses, not read. ``DynamicDecodeOp`` is greedy argmax (new tokens, output ids, finished flags, sequence lengths,
indirection copy). ``gather_tree`` is a view of ``output_ids``. ``cudaStreamBeginCapture``/``EndCapture`` +
``cudaGraphInstantiate`` is the engine's ``graph()`` on a ``new_graph``. ``cudaGraphExecUpdate`` hands back the newly
captured graph as the instance, and ``cudaGraphUpload`` is left out. Streams, pipeline parallelism, custom all-reduce,
paged KV and beams are left out. Host tensors are ``host()`` memory.
Workload: ``gpt_benchmark``'s loop with one warm-up and one measured iteration. Each iteration does ``setup(2, 4, 5)``
and then ``decode()`` of the same two 4-token prompts for 5 new tokens. Outputs: each iteration's output ids. Eager:
the same loop with ``cuda_graph_mode=False``.
Measured: bug: misbehaves (raised IllegalMemoryAccess: graph replay read freed memory: aten._to_copy.default at
<this file>:<line> in enqueue: hidden = self.wte[t["input_ids"].long()] + self.wpe[t["position_ids"].long()]).
The rest of the message says the replay "reads a int32[2, 1] tensor (8 bytes) that the graph does not own": decode
#1's ``new_tokens``. This is decode #2's step 0 launching decode #1's step-4 instance (traced: run 1 runs the context
eagerly, then replays the graphs of steps 1-4; run 2 replays the step-4 graph again at step 0). Fix: equals eager
(max |graph - eager| = 0). Each decode runs its context eagerly and replays its 4 freshly captured generation graphs,
and both iterations give the eager output ids. About 1 s per variant on the CPU. On one H100 (2026-12-07, torch
2.11): the bug's replay at step 0 gathers embeddings with whatever the freed ``new_tokens`` block holds by then, and
the context ends in a device-side assert ("vectorized gather kernel index out of bounds"); the fix equals eager.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import weakref

import torch

from workbench.engine import events, graph, host, new_graph
from workbench.zoo import kit
from workbench.zoo.kit import compare, generator, randn, remember_step, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/148"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "handle_per_step"
SYMPTOM = ("with cuda_graph_mode every decode() after the first skips its context phase: the context-step cleanup "
           "cleared the session's attribute, not the runtime's instances, so step 0 launches the previous decode's "
           "last generation graph, bound to buffers released since")

DTYPE = torch.float64
VOCAB, HIDDEN, NUM_LAYERS, MAX_POSITIONS = 32, 16, 2, 16
BATCH, INLEN, OUTLEN, WARM_UP, NUM_RUNS = 2, 4, 5, 1, 1
OWNER = "GenerationSession"
_variant = "bug"


# --- the TensorRT engine and its execution contexts (stand-ins) -----------------------------------------------------

class GptEngine:
    """The deserialized engine (``trt.ICudaEngine``): a GPT network built with the GPT attention plugin."""

    def __init__(self, device):
        gen = generator(148)
        w = lambda *s, scale: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.device = device
        self.wte, self.wpe = w(VOCAB, HIDDEN, scale=0.8), w(MAX_POSITIONS, HIDDEN, scale=0.5)
        self.layers = [dict(qkv=w(HIDDEN, 3 * HIDDEN, scale=0.4), proj=w(HIDDEN, HIDDEN, scale=0.4),
                            fc=w(HIDDEN, 2 * HIDDEN, scale=0.4), out=w(2 * HIDDEN, HIDDEN, scale=0.4))
                       for _ in range(NUM_LAYERS)]
        self.inputs = ["input_ids", "position_ids", "last_token_ids", "context_lengths", "cache_indirection",
                       "sequence_length", "host_past_key_value_lengths", "host_request_types",
                       *[f"past_key_value_{i}" for i in range(NUM_LAYERS)]]
        self.outputs = ["logits", *[f"present_key_value_{i}" for i in range(NUM_LAYERS)]]

    def gpt_attention(self, q, k, v, kv_cache, t):
        """The GPT attention plugin (guessed): ``kv_cache`` is ``[batch, 2, heads, max_seq, head_size]``."""
        request_types = t["host_request_types"].tolist()             # host: read at enqueue
        rows = torch.arange(q.shape[0], device=q.device)
        if request_types[0] == 0:                                     # context phase: the whole prompt
            n = q.shape[1]
            kv_cache[:, 0, 0, :n] = k
            kv_cache[:, 1, 0, :n] = v
            pos = torch.arange(n, device=q.device)
            causal = pos[None, None, :] <= pos[None, :, None]
            mask = causal & (pos[None, None, :] < t["context_lengths"][:, None, None])
            keys, values = k, v
        else:                                                         # generation phase: one token per sequence
            past = t["host_past_key_value_lengths"].tolist()[0::2]   # host: read at enqueue
            span = max(past) + 1
            seq = t["sequence_length"].long()
            kv_cache[rows, 0, 0, seq - 1] = k[:, 0]
            kv_cache[rows, 1, 0, seq - 1] = v[:, 0]
            pos = torch.arange(span, device=q.device)
            src = rows[:, None] + t["cache_indirection"][:, 0, :span].long()   # beam width 1: batch * 1 + beam
            keys, values = kv_cache[src, 0, 0, pos[None, :]], kv_cache[src, 1, 0, pos[None, :]]
            mask = pos[None, None, :] < seq[:, None, None]
        scores = (q @ keys.transpose(1, 2) / math.sqrt(HIDDEN)).masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ values

    def enqueue(self, t):
        """What ``execute_async_v3`` launches: reads the bound inputs, writes ``logits`` and the KV caches in place."""
        hidden = self.wte[t["input_ids"].long()] + self.wpe[t["position_ids"].long()]
        for i, layer in enumerate(self.layers):
            q, k, v = (hidden @ layer["qkv"]).split(HIDDEN, dim=-1)
            hidden = hidden + self.gpt_attention(q, k, v, t[f"past_key_value_{i}"], t) @ layer["proj"]
            hidden = hidden + torch.tanh(hidden @ layer["fc"]) @ layer["out"]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = hidden[rows, t["last_token_ids"].long() - 1]
        t["logits"].copy_(torch.tanh(last) @ self.wte.t())


class IExecutionContext:
    """``trt.IExecutionContext``: input shapes and tensor addresses, then ``execute_async_v3``. TensorRT keeps raw
    addresses; a weak reference is the same here (the caller keeps the tensor alive, or nobody does)."""

    def __init__(self, engine):
        self.engine, self._shapes, self._addresses = engine, {}, {}

    def set_input_shape(self, name, shape):
        self._shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        return self._shapes.get(name, (1,))

    def set_tensor_address(self, name, tensor):
        self._addresses[name] = weakref.ref(tensor)

    def execute_async_v3(self, stream):
        self.engine.enqueue({name: ref() for name, ref in self._addresses.items()})
        return True


def _update_cuda_graph_instance(instance, graph):
    """``cudaGraphExecUpdate(instance, graph)``: the instance now runs ``graph``'s nodes (stand-in: it is ``graph``)."""
    return graph


class _Runtime:
    def __init__(self, engine):
        self.engine = engine
        # cuda graph ping-pong instances
        self.cuda_graph_instances = [None for _ in range(2)]
        # one optimization profile: at step 0 context_1 is active (as ctx_context), at step 1 context_0, ...
        self.context_0, self.context_1 = IExecutionContext(engine), IExecutionContext(engine)
        self.ctx_context = self.context_1

    def _set_shape(self, context, shape_dict):
        for name in self.engine.inputs:
            context.set_input_shape(name, shape_dict[name])

    def _set_buffer(self, context, buffer_dict):
        for name in self.engine.inputs + self.engine.outputs:
            if name not in buffer_dict:
                buffer_dict[name] = torch.zeros(context.get_tensor_shape(name), dtype=DTYPE,
                                                device=self.engine.device)
            context.set_tensor_address(name, buffer_dict[name])

    def _run(self, context, stream=None):
        return context.execute_async_v3(stream)


# --- tensorrt_llm/runtime/generation.py (reduced) -------------------------------------------------------------------

@dataclasses.dataclass
class SamplingConfig:
    end_id: int
    pad_id: int
    num_beams: int = 1


class DynamicDecodeOp:
    """``torch.classes.FasterTransformer.DynamicDecodeOp`` with top_k=1 (stand-in)."""

    def forward(self, logits, step, max_context_length, end_ids, src_cache_indirection, output_ids, new_tokens,
                finished, sequence_lengths, tgt_cache_indirection):
        tokens = torch.where(finished[:, 0], end_ids, logits[:, 0].argmax(-1).to(torch.int32))
        new_tokens.copy_(tokens.view(new_tokens.shape))
        output_ids[:, step] = tokens
        sequence_lengths.add_((~finished[:, 0]).to(torch.int32))
        finished[:, 0] |= tokens == end_ids
        tgt_cache_indirection.copy_(src_cache_indirection)
        return finished.all()


def _captured(g, fn):
    remember_step(g, fn)
    for hook in kit.hooks:
        hook.captured(g, fn)


class GenerationSession:
    def __init__(self, engine, device, cuda_graph_mode=False):
        self.runtime, self.device, self.cuda_graph_mode = _Runtime(engine), device, cuda_graph_mode
        self.buffer, self.buffer_allocated = None, False
        self.dynamic_decoder = DynamicDecodeOp()

    def setup(self, batch_size, max_context_length, max_new_tokens, beam_width=1):
        self.batch_size, self.max_context_length, self.max_new_tokens = batch_size, max_context_length, max_new_tokens
        self.max_seq_length, self.beam_width = max_context_length + max_new_tokens, beam_width
        self.buffer = {}
        self.buffer["logits"] = torch.empty((batch_size, VOCAB), dtype=DTYPE, device=self.device)
        cache_shape = (batch_size, 2, 1, self.max_seq_length, HIDDEN)
        for i in range(NUM_LAYERS):
            self.buffer[f"present_key_value_{i}"] = torch.empty(cache_shape, dtype=DTYPE, device=self.device)
        self.sequence_length_buffer = torch.ones((batch_size,), dtype=torch.int32, device=self.device)
        events.persistent_state(OWNER, {f"present_key_value_{i}": self.buffer[f"present_key_value_{i}"]
                                        for i in range(NUM_LAYERS)})
        self.buffer_allocated = True

    def __setup_decoder(self, input_ids, scfg, host_context_lengths):
        batch_size = host_context_lengths.shape[0]
        self.end_ids = torch.full((batch_size * scfg.num_beams,), scfg.end_id, dtype=torch.int32, device=self.device)
        self.output_ids = torch.cat((input_ids, torch.full((batch_size, self.max_seq_length - self.max_context_length),
                                                           scfg.end_id, dtype=input_ids.dtype, device=self.device)),
                                    dim=-1)
        self.new_tokens = torch.zeros([batch_size, 1], dtype=torch.int32, device=self.device)
        self.finished = torch.zeros((batch_size, scfg.num_beams), dtype=torch.bool, device=self.device)

    def _get_context_shape_buffer(self, input_ids, context_lengths, position_ids, last_token_ids, cache_indirection):
        batch_size = context_lengths.shape[0]
        host_request_types = host(torch.zeros(batch_size, dtype=torch.int32), self.device)
        ctx_buffer = {
            "context_lengths": context_lengths.contiguous(),
            "cache_indirection": cache_indirection.contiguous(),
            "position_ids": position_ids.contiguous(),
            "logits": self.buffer["logits"],
            "last_token_ids": last_token_ids.contiguous(),
            "input_ids": input_ids.contiguous(),
            "sequence_length": self.sequence_length_buffer,
            # field 0: past_key_value_length, field 1: is_context
            "host_past_key_value_lengths": host(torch.tensor([0, 1] * batch_size, dtype=torch.int32), self.device),
            "host_request_types": host_request_types,
        }
        for idx in range(NUM_LAYERS):
            ctx_buffer[f"past_key_value_{idx}"] = self.buffer[f"present_key_value_{idx}"]
            ctx_buffer[f"present_key_value_{idx}"] = self.buffer[f"present_key_value_{idx}"]
        ctx_shape = {name: tuple(ctx_buffer[name].shape) for name in self.runtime.engine.inputs}
        return ctx_shape, ctx_buffer

    def _get_next_step_shape_buffer(self, batch_size, beam_width, max_context_length, step, context_lengths,
                                    position_ids, last_token_ids, cache_indirection):
        next_step_buffer = {
            "context_lengths": context_lengths.contiguous(),
            "cache_indirection": cache_indirection.contiguous(),
            "logits": self.buffer["logits"],
            "last_token_ids": last_token_ids.contiguous(),
            "input_ids": self.new_tokens,
            "position_ids": position_ids.contiguous(),
            # Sequence lengths are not used in the context phase actually.
            "sequence_length": self.sequence_length_buffer,
            "host_past_key_value_lengths": host(torch.tensor([max_context_length + step, 0] * (batch_size * beam_width),
                                                             dtype=torch.int32), self.device),
            "host_request_types": host(torch.ones(batch_size, dtype=torch.int32), self.device),
        }
        for idx in range(NUM_LAYERS):
            next_step_buffer[f"past_key_value_{idx}"] = self.buffer[f"present_key_value_{idx}"]
            next_step_buffer[f"present_key_value_{idx}"] = self.buffer[f"present_key_value_{idx}"]
        next_step_shape = {name: tuple(next_step_buffer[name].shape) for name in self.runtime.engine.inputs}
        return next_step_shape, next_step_buffer

    def _prepare_context_inputs(self, batch_size, context_lengths, max_context_length):
        last_token_ids = context_lengths.detach().clone()
        position_ids = torch.arange(max_context_length, dtype=torch.int32, device=self.device).reshape(
            [1, -1]).expand([batch_size, -1])
        return {"last_token_ids": last_token_ids, "position_ids": position_ids}

    def _prepare_generation_inputs(self, batch_size, context_lengths, step):
        last_token_ids = torch.ones_like(context_lengths)
        position_ids = torch.unsqueeze(context_lengths + step, 1)
        return {"last_token_ids": last_token_ids, "position_ids": position_ids}

    def handle_per_step(self, cache_indirections, step, batch_size, max_context_length, beam_width, input_ids, scfg,
                        context_lengths, next_step_buffer):
        if step % 2:
            context = self.runtime.context_0
            this_src_cache_indirection, this_tgt_cache_indirection = cache_indirections[1], cache_indirections[0]
            next_src_cache_indirection = cache_indirections[0]
        else:
            context = self.runtime.context_1
            this_src_cache_indirection, this_tgt_cache_indirection = cache_indirections[0], cache_indirections[1]
            next_src_cache_indirection = cache_indirections[1]

        if step == 0:
            model_inputs = self._prepare_context_inputs(batch_size, context_lengths, max_context_length)
            ctx_shape, ctx_buffer = self._get_context_shape_buffer(
                input_ids, context_lengths, model_inputs["position_ids"], model_inputs["last_token_ids"],
                this_src_cache_indirection)
            context = self.runtime.ctx_context
            self.runtime._set_shape(context, ctx_shape)
            self.runtime._set_buffer(context, ctx_buffer)
            if self.cuda_graph_mode:
                # context mode, clean cuda graph instances
                if _variant == "bug":
                    self.cuda_graph_instances = [None for _ in range(2)]            # before #148
                else:
                    self.runtime.cuda_graph_instances = [None for _ in range(2)]    # #148

        stream = None       # torch.cuda.current_stream().cuda_stream
        instance_idx = step % 2
        if self.cuda_graph_mode and self.runtime.cuda_graph_instances[instance_idx] is not None:
            # launch cuda graph
            replay(self.runtime.cuda_graph_instances[instance_idx], self.buffer["logits"])
            ok = True
        else:
            ok = self.runtime._run(context, stream)
        if not ok:
            raise RuntimeError("Executing TRT engine failed!")

        # Initialize sequence_lengths (no paddings) for the generation phase.
        if step == 0:
            self.sequence_length_buffer = context_lengths.detach().clone()

        if not step == self.max_new_tokens - 1:
            # Set shape and address for the next step
            model_inputs = self._prepare_generation_inputs(batch_size, context_lengths, step)
            next_context = self.runtime.context_1 if step % 2 else self.runtime.context_0
            next_step_shape, next_step_buffer = self._get_next_step_shape_buffer(
                batch_size, beam_width, max_context_length, step, context_lengths, model_inputs["position_ids"],
                model_inputs["last_token_ids"], next_src_cache_indirection)
            self.runtime._set_shape(next_context, next_step_shape)
            self.runtime._set_buffer(next_context, next_step_buffer)
            if self.cuda_graph_mode:
                # capture cuda graph (cudaStreamBeginCapture .. cudaStreamEndCapture, then instantiate or update)
                next_graph = new_graph(self.device)
                with graph(next_graph, name=f"generation step {step + 1}"):
                    next_context.execute_async_v3(stream)
                _captured(next_graph, functools.partial(next_context.execute_async_v3, stream))
                instance_idx = (step + 1) % 2
                if self.runtime.cuda_graph_instances[instance_idx] is not None:
                    self.runtime.cuda_graph_instances[instance_idx] = _update_cuda_graph_instance(
                        self.runtime.cuda_graph_instances[instance_idx], next_graph)
                else:
                    self.runtime.cuda_graph_instances[instance_idx] = next_graph

        logits = self.buffer["logits"]
        next_token_logits = logits.reshape((batch_size, beam_width, -1))
        decode_step = step + max_context_length
        should_stop = self.dynamic_decoder.forward(
            next_token_logits, decode_step, max_context_length, self.end_ids, this_src_cache_indirection,
            self.output_ids, self.new_tokens, self.finished, self.sequence_length_buffer, this_tgt_cache_indirection)
        return should_stop, next_step_buffer

    def finalize_decoder(self, batch_size, beam_width):
        return self.output_ids.view(batch_size, beam_width, self.max_seq_length)    # gather_tree, beam width 1

    def decode_regular(self, batch_size, scfg, context_lengths, max_context_length, beam_width, cache_indirections,
                       input_ids):
        next_step_buffer = None
        for step in range(0, self.max_new_tokens):
            should_stop, next_step_buffer = self.handle_per_step(
                cache_indirections, step, batch_size, max_context_length, beam_width, input_ids, scfg,
                context_lengths, next_step_buffer)
            if should_stop is not None and should_stop.item():
                return self.finalize_decoder(batch_size, beam_width)
        return self.finalize_decoder(batch_size, beam_width)

    def decode(self, input_ids, context_lengths, sampling_config):
        scfg = sampling_config
        batch_size, beam_width = context_lengths.size(0), scfg.num_beams
        max_context_length = torch.max(context_lengths).item()
        host_context_lengths = context_lengths.cpu()
        assert batch_size == self.batch_size and max_context_length == self.max_context_length
        assert beam_width == self.beam_width
        self.__setup_decoder(input_ids, scfg, host_context_lengths)
        if not self.buffer_allocated:
            raise RuntimeError("Buffer not allocated, please call setup first!")
        cache_indirections = [
            torch.full((batch_size, beam_width, self.max_seq_length), 0, dtype=torch.int32, device=self.device),
            torch.full((batch_size, beam_width, self.max_seq_length), 0, dtype=torch.int32, device=self.device),
        ]  # ping-pong buffers
        events.static_buffers(OWNER, {"new_tokens": self.new_tokens})
        return self.decode_regular(batch_size, scfg, context_lengths, max_context_length, beam_width,
                                   cache_indirections, input_ids)


# --- benchmarks/python/gpt_benchmark.py: the only caller with cuda_graph_mode at that commit ------------------------

def _serve(device, cuda_graph_mode):
    engine = GptEngine(device)
    decoder = GenerationSession(engine, device, cuda_graph_mode=cuda_graph_mode)
    sampling_config = SamplingConfig(end_id=VOCAB - 1, pad_id=VOCAB - 1)
    gen = generator(1480)
    input_ids = torch.randint(VOCAB - 1, (BATCH, INLEN), generator=gen).int().to(device)
    input_lengths = torch.tensor([INLEN for _ in range(BATCH)]).int().to(device)
    outputs = []
    for _ in range(WARM_UP + NUM_RUNS):                     # benchmarker.run(inputs, config)
        decoder.setup(BATCH, INLEN, OUTLEN, beam_width=1)
        outputs.append(decoder.decode(input_ids, input_lengths, sampling_config).clone())
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        with torch.no_grad():
            return compare(__name__.rsplit(".", 1)[-1], variant, device,
                           lambda: _serve(device, True), lambda: _serve(device, False))
    finally:
        _variant = "bug"
