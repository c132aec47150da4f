"""The breakable-cudagraph flag is read at import, before it is set: prefill attention is captured as ``fill_(0)``.

Upstream: https://github.com/pytorch/torchtitan/pull/3829 ("[rl] fix the breakable cudagraph env var", commit
9e4a8512b14b9b0f6931d0619ca91f05b25bb2d6, June 2026).
Symptom: async-RL generation (Qwen3-30B-A3B, vLLM generator with ``cudagraph.mode=FULL_AND_PIECEWISE``)
produced fluent, coherent text that ignored the prompt (asked to sort Charlie, Alice, Bob, it rambled about
"software development"), and the reward never increased; FULL_DECODE_ONLY and eager were correct. An
instrumented run showed ``is_breakable=False`` at import in all four EngineCore workers.
Mechanism: ``PyTorchVarlenAttentionImpl.forward`` (``rl/models/attention.py``) is decorated with vLLM's
``@eager_break_during_capture``, which checks ``VLLM_USE_BREAKABLE_CUDAGRAPH`` once, when it decorates, i.e.
when ``attention.py`` is imported: disabled, it returns the function unchanged. The generator set the variable
at runtime (``Generator.__init__``, ``generator.py:778``), after the actor had imported ``attention.py`` and
outside the launch environment of the vLLM EngineCore worker subprocesses, which import it again. In the
workers the decorator was a no-op, so the prefill forward was captured like any other op. During capture the
forward sees the dummy capture batch (``attn_metadata is None``) and takes ``return output.fill_(0)``: the
graph records "zero the attention output" for every layer, and replays never read the prompt. With the break
in place, ``BreakableCUDAGraphCapture.add_eager`` ends the segment and replays re-run ``forward`` eagerly,
which re-reads the live metadata through ``get_attention_context``.
Doctor: warmup-divergence, at ``forward`` (``PyTorchVarlenAttentionImpl.forward``: its ``attn_metadata is None``
branch was decided on the capture batch and is replayed for real prompts, where eager attends).
Fix (upstream): ``breakable_cudagraph_env(generator_cfg)`` returns ``{"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}``
for an enabled FULL_AND_PIECEWISE cudagraph; ``spawn_proc_mesh(generator_env=...)`` threads it to
``PerHostProvisioner.allocate(extra_env=...)``, whose ``_bootstrap`` puts it in ``os.environ`` before any
import, so the actor and every EngineCore worker launch with it.
Read: the diff (``train.py``), the parent's ``attention.py`` and ``generator.py``, and vLLM's
``breakable_cudagraph.py``. Simplified: one process stands for the worker, which inherits the actor's launch
environment (not its runtime ``os.environ``, as the commit reports); prefill only, no KV cache (each prompt
attends to itself); the worker captures one prefill size; two layers.
"""
from __future__ import annotations

import functools
import types

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/pytorch/torchtitan/pull/3829"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = "FULL_AND_PIECEWISE generator ignores the prompt: prefill attention replays as zeros"

VOCAB, DIM, LAYERS, SIZE, MAX_REQS = 13, 8, 2, 8, 4        # SIZE: the captured prefill token count


# ----------------------------------------------------------------------------- processes
class Process:
    """One OS process: the environment it was launched with, its ``os.environ``, and its own imports."""

    def __init__(self, name: str, launch_env: dict):
        self.name = name
        self.launch_env = dict(launch_env)
        self.environ = dict(launch_env)            # os.environ
        self.modules: dict = {}                    # sys.modules

    def import_module(self, name: str):
        if name not in self.modules:               # a module body runs once per process, at first import
            self.modules[name] = MODULES[name](self)
        return self.modules[name]


# ----------------------------------------------------------------------------- vLLM forward context
_forward_context = types.SimpleNamespace(attn_metadata=None)


def set_forward_context(attn_metadata):
    _forward_context.attn_metadata = attn_metadata


def get_attention_context(layer_name):
    """The live per-layer metadata (vLLM refreshes the forward context before each step)."""
    return _forward_context.attn_metadata


class FlashAttentionMetadata:
    def __init__(self, query_start_loc, num_actual_tokens: int):
        self.query_start_loc = query_start_loc
        self.num_actual_tokens = num_actual_tokens


# ----------------------------------------------------------------------------- vllm/compilation/breakable_cudagraph.py
class BreakableCUDAGraphCapture:
    """One capture context for the whole forward; a decorated op ends the segment, runs eagerly, and a new
    segment begins. Replay runs the segments (graph replays and eager callables) in order."""

    _active = None

    @classmethod
    def current(cls):
        return cls._active

    def __init__(self, device, pool):
        self.device, self.pool = device, pool
        self.segments: list = []
        self.graphs: list = []
        self._current_graph, self._cm, self._capturing = None, None, False

    def __enter__(self):
        BreakableCUDAGraphCapture._active = self
        self._begin_segment()
        return self

    def __exit__(self, *exc):
        try:
            self._end_segment(*exc)
        finally:
            BreakableCUDAGraphCapture._active = None

    def _begin_segment(self):
        g = new_graph(self.device)
        self._cm = graph(g, pool=self.pool, name=f"prefill {SIZE} segment {len(self.graphs)}")
        self._cm.__enter__()
        self._current_graph, self._capturing = g, True

    def _end_segment(self, *exc):
        if not self._capturing:
            return
        self._cm.__exit__(*(exc or (None, None, None)))
        self.segments.append(self._current_graph.replay)
        self.graphs.append(self._current_graph)
        self._current_graph, self._cm, self._capturing = None, None, False

    def add_eager(self, fn):
        self._end_segment()
        with events.dummy_run():                  # runs on the capture's dummy batch
            result = fn()
        self.segments.append(fn)
        self._begin_segment()
        return result

    def replay(self):
        for r in self.segments:
            r()


def _import_breakable_cudagraph(proc: Process):
    def is_breakable_cudagraph_enabled() -> bool:
        return proc.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1"      # envs.VLLM_USE_BREAKABLE_CUDAGRAPH

    def eager_break_during_capture(fn):
        if not is_breakable_cudagraph_enabled():
            return fn

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            capture = BreakableCUDAGraphCapture.current()
            if capture is None or not capture._capturing:
                return fn(*args, **kwargs)
            return capture.add_eager(lambda: fn(*args, **kwargs))
        return wrapper

    return types.SimpleNamespace(eager_break_during_capture=eager_break_during_capture,
                                 is_breakable_cudagraph_enabled=is_breakable_cudagraph_enabled)


# ----------------------------------------------------------------------------- torchtitan rl/models/attention.py
def varlen_attn_out(out, q, k, v, cu_seqlens_q, num_actual_tokens: int):
    """Causal varlen attention of the batch's own tokens (prefill, no cached context)."""
    t = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens_q, t, right=True) - 1
    mask = (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None])
    scores = (q @ k.T) / DIM ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    out.copy_(torch.softmax(scores, -1) @ v)
    return out


def _import_attention(proc: Process):
    """The module body: the class is defined (and its ``forward`` decorated) at import."""
    breakable = proc.import_module("vllm.compilation.breakable_cudagraph")

    class PyTorchVarlenAttentionImpl:
        # @eager_break_during_capture makes this forward a break point for vLLM's breakable cudagraph
        @breakable.eager_break_during_capture
        def forward(self, layer, query, key, value, attn_metadata, output=None):
            # Re-read live per-layer metadata from the forward context (refreshed before each replay)
            attn_metadata = get_attention_context(layer.layer_name)
            if attn_metadata is None:
                # Profiling / cudagraph dummy-capture run (no real metadata yet).
                return output.fill_(0)
            n = attn_metadata.num_actual_tokens
            return varlen_attn_out(output[:n], query[:n], key[:n], value[:n], attn_metadata.query_start_loc, n)

    return types.SimpleNamespace(PyTorchVarlenAttentionImpl=PyTorchVarlenAttentionImpl)


MODULES = {"vllm.compilation.breakable_cudagraph": _import_breakable_cudagraph,
           "torchtitan.experiments.rl.models.attention": _import_attention}


# ----------------------------------------------------------------------------- the model (in the worker)
class Attention:
    """vLLM's ``Attention`` layer: hands the impl the step's metadata from the forward context."""

    def __init__(self, impl, i):
        self.impl, self.layer_name = impl, f"layers.{i}.attn"

    def __call__(self, q, k, v):
        output = torch.empty_like(q)                       # in-place output buffer
        self.impl.forward(self, q, k, v, get_attention_context(self.layer_name), output=output)
        return output


class Qwen3Model:
    def __init__(self, attention_module, device):
        gen = generator(3829)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(SIZE, DIM, gen=gen, device=device, scale=0.5)
        self.w = [[randn(DIM, DIM, gen=gen, device=device, scale=0.4) for _ in range(4)] for _ in range(LAYERS)]
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.attn = [Attention(attention_module.PyTorchVarlenAttentionImpl(), i) for i in range(LAYERS)]

    def forward(self, input_ids, positions):
        h = self.emb[input_ids] + self.pos[positions]
        for (wq, wk, wv, wo), attn in zip(self.w, self.attn):
            h = h + attn(h @ wq, h @ wk, h @ wv) @ wo
        return h @ self.lm_head


class GPUModelRunner:
    def __init__(self, model, device, cudagraph: bool):
        self.model, self.device, self.cudagraph = model, device, cudagraph
        self.input_ids = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.positions = torch.zeros(SIZE, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_REQS + 1, dtype=torch.long, device=device)
        self.capture = self.logits = None

    def capture_model(self):
        """FULL_AND_PIECEWISE: the prefill size is captured on a dummy batch (no attention metadata)."""
        events.static_buffers("GPUModelRunner (prefill cudagraph)",
                              {"input_ids": self.input_ids, "positions": self.positions,
                               "query_start_loc": self.query_start_loc})
        set_forward_context(None)
        with events.warmup():
            self.model.forward(self.input_ids, self.positions)
        self.capture = BreakableCUDAGraphCapture(self.device, graph_pool_handle(self.device))
        with self.capture:
            self.logits = self.model.forward(self.input_ids, self.positions)

    def execute_model(self, prompts, positions_list):
        n = sum(len(p) for p in prompts)
        tokens = [t for p in prompts for t in p]
        qsl = [0]
        for p in prompts:
            qsl.append(qsl[-1] + len(p))
        qsl += [qsl[-1]] * (MAX_REQS + 1 - len(qsl))
        last = torch.tensor([q - 1 for q in qsl[1:len(prompts) + 1]], device=self.device)
        self.input_ids[:n].copy_(torch.tensor(tokens, device=self.device))
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(torch.tensor(positions_list, device=self.device))
        self.positions[n:].zero_()
        self.query_start_loc.copy_(torch.tensor(qsl, device=self.device))
        set_forward_context(FlashAttentionMetadata(self.query_start_loc, n))
        if self.capture is None:                            # eager
            return self.model.forward(self.input_ids[:n], self.positions[:n])[last].clone()
        events.serve(self.capture.graphs[0], n, SIZE, outputs=self.logits, pieces=tuple(self.capture.graphs),
                     eager=lambda: self.model.forward(self.input_ids, self.positions))
        self.capture.replay()
        events.handed_out(self.capture.graphs[-1], self.logits)
        return self.logits[last].clone()


# ----------------------------------------------------------------------------- torchtitan rl/train.py, generator.py
class CudagraphConfig:
    def __init__(self, enable: bool, mode: str = "FULL_AND_PIECEWISE"):
        self.enable, self.mode = enable, mode


def breakable_cudagraph_env(generator_cfg) -> dict:
    """(the fix) Per-proc launch env a FULL_AND_PIECEWISE generator needs."""
    cg = generator_cfg.cudagraph
    if cg.enable and cg.mode == "FULL_AND_PIECEWISE":
        return {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    return {}


class PerHostProvisioner:
    def allocate(self, num_gpus: int, *, extra_env=None):
        def _bootstrap(env: dict):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(num_gpus))
            if extra_env:
                env.update(extra_env)
        return _bootstrap


def spawn_proc_mesh(name: str, generator_env=None) -> Process:
    env: dict = {}
    PerHostProvisioner().allocate(1, extra_env=generator_env)(env)
    proc = Process(name, env)
    # unpickling the generator's model spec imports rl/models/attention.py before Generator.__init__
    proc.import_module("torchtitan.experiments.rl.models.attention")
    return proc


class Generator:
    def __init__(self, proc: Process, cudagraph: CudagraphConfig, device):
        # (pre-fix) set at runtime: too late for the modules this process already imported
        if cudagraph.enable and cudagraph.mode == "FULL_AND_PIECEWISE":
            proc.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
        # vLLM EngineCore worker: a subprocess launched with the proc's launch env; it imports attention.py
        worker = Process("EngineCore_0", proc.launch_env)
        attention = worker.import_module("torchtitan.experiments.rl.models.attention")
        self.runner = GPUModelRunner(Qwen3Model(attention, device), device, cudagraph.enable)
        if cudagraph.enable:
            self.runner.capture_model()


def run(variant: str, device: str = "cpu"):
    def serve(enable: bool):
        config = types.SimpleNamespace(cudagraph=CudagraphConfig(enable))
        generator_env = breakable_cudagraph_env(config) if variant == "fix" else None
        proc = spawn_proc_mesh("generator", generator_env=generator_env)
        gen = Generator(proc, config.cudagraph, device)
        outs = []
        for prompts in ([[3, 7, 1], [2, 5, 9, 4]], [[8, 1, 6, 2, 11]], [[4, 4], [12, 3], [0, 5, 7]]):
            positions = [i for p in prompts for i in range(len(p))]
            outs.append(gen.runner.execute_model(prompts, positions))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
