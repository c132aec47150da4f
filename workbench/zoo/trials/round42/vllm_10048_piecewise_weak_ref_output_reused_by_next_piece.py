"""Piecewise CUDA graphs weak-ref every piece's output inside its capture: the next piece's capture reuses the block.

Upstream: https://github.com/vllm-project/vllm/pull/10048 ("[bugfix] fix weak ref in piecewise cudagraph and
tractable test", commit ca9844b34, merged November 2024), a follow-up to #9724 (cudagraph output kept as a
tensor weak reference).
Symptom: with piecewise compilation and CUDA graphs (``CompilationLevel.PIECEWISE``, attention as a splitting
op), the model's output differed from eager; the toy-llama test had not seen it because its weights were all
zero, so the PR rewrites it as a "tractable" model whose closed-form result the graph run must match.
Mechanism: ``PiecewiseBackend.__call__`` captured each piecewise subgraph with ``with torch.cuda.graph(cudagraph,
pool=self.graph_pool): entry.output = weak_ref_tensors(entry.runnable(*args))``. The weak reference drops the
only strong reference to the piece's outputs *inside* the capture, so their blocks go back to the shared
``graph_pool`` at once, and the piece returns only the weak references to the split module. The split module
hands those outputs (``attn_output`` buffer, ``residual``) through the attention op (a splitting op, run
eagerly) to the next piece, whose capture into the same pool places its own temporaries in the freed blocks:
at every replay, piece k+1 writes over piece k's outputs (here its first matmul lands on ``residual``) before
it reads them. Also, ``split_graph`` sorted the submodules by string name (``submod_10`` before ``submod_2``),
so the "first"/"last" piece was the wrong one once there were more than ten submodules (here 13: with the
fix's last-piece rule but string order, ``submod_8`` would be weak-ref'd and ``submod_10`` would reuse it).
Doctor: dangling-reference, at ``__call__`` (``PiecewiseBackend.__call__``, whose captured closure weak-refs
the outputs inside the capture: it releases memory the next piece's graph still reads).
Modelled from the diff of ``vllm/compilation/backends.py`` and the PR's test (``tests/compile/piecewise/
test_toy_llama.py``: the toy llama, the ``silly.attention`` splitting op writing into an ``attn_output``
buffer made by the preceding piece); ``weak_ref_tensor`` rebuilds the tensor on a non-owning storage, as
vLLM's C++ op does with ``from_blob``.
Fix (upstream): only the last piece (``is_last_graph``, from ``piecewise_compile_index`` /
``total_piecewise_compiles``) converts its output to a weak reference inside the capture; the others return
the strong ``output`` to the caller (so the allocator keeps it while later pieces are captured) and keep a weak
ref in ``entry.output`` for replays; ``SplitItem`` gains an integer ``graph_id`` and outputs are sorted by it.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/10048"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "__call__"
SYMPTOM = "piecewise-graph model output differs from eager (intermediate piece outputs overwritten in the pool)"

HIDDEN, MLP, VOCAB, NUM_LAYERS = 4, 8, 16, 6    # 6 layers: submod_0 .. submod_12 (> 10 submodules)
CAPTURE_SIZES = [2, 4]
MAX_NUM_TOKENS = 8
CUDAGRAPH_NUM_OF_WARMUPS = 1


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``torch.ops._C.weak_ref_tensor`` (``torch::from_blob`` on the data pointer): a tensor at the same
    address, shape and strides whose storage does not own, nor keep alive, the original's memory."""
    storage = tensor.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        weak, tensor.storage_offset(), tensor.shape, tensor.stride())


def weak_ref_tensors(tensors):
    if isinstance(tensors, torch.Tensor):
        return weak_ref_tensor(tensors)
    return tuple(weak_ref_tensor(t) for t in tensors)


# ------------------------------------------------------------------ the model (toy llama of the test)
class LlamaModel:
    def __init__(self, device):
        gen = generator(10048)
        self.embedding_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=0.5)
        self.qkv_projection = [randn(HIDDEN, 3 * HIDDEN, gen=gen, device=device, scale=0.4) for _ in range(NUM_LAYERS)]
        self.output_projection = [randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4) for _ in range(NUM_LAYERS)]
        self.gate_up_projection = [randn(HIDDEN, 2 * MLP, gen=gen, device=device, scale=0.4) for _ in range(NUM_LAYERS)]
        self.down_projection = [randn(MLP, HIDDEN, gen=gen, device=device, scale=0.3) for _ in range(NUM_LAYERS)]

    def pre_attention(self, i, positions, hidden_states, residual):
        """``LlamaDecoderLayer.forward`` up to the attention op, and ``LlamaAttention`` up to it."""
        if residual is None:
            residual = hidden_states
        else:
            hidden_states = hidden_states + residual
            residual = hidden_states
        hidden_states = hidden_states * 0.5
        qkv = hidden_states @ self.qkv_projection[i]
        q, k, v = qkv.split([HIDDEN, HIDDEN, HIDDEN], dim=-1)
        q = q + positions.unsqueeze(1)
        k = k + positions.unsqueeze(1)
        attn_output = torch.empty_like(q)
        return q, k, v, attn_output, residual

    def post_attention(self, i, attn_output, residual):
        """The rest of layer ``i``: output projection, residual add, MLP."""
        hidden_states = attn_output @ self.output_projection[i]
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = hidden_states * 0.5
        x = hidden_states @ self.gate_up_projection[i]
        x = x[:, :MLP] * torch.relu(x[:, MLP:])
        return x @ self.down_projection[i], residual

    def forward(self, input_ids, positions):
        """The eager model (``run_model(..., use_compile=False)``)."""
        hidden_states, residual = self.embedding_tokens[input_ids], None
        for i in range(NUM_LAYERS):
            q, k, v, attn_output, residual = self.pre_attention(i, positions, hidden_states, residual)
            silly_attention(q, k, v, attn_output)
            hidden_states, residual = self.post_attention(i, attn_output, residual)
        return hidden_states


def silly_attention(q, k, v, out):
    """``torch.ops.silly.attention`` of the test: the splitting op (``non_cudagraph_ops``), run eagerly."""
    out.copy_(q)
    out += k
    out += v


def submodule(model, graph_id):
    """What ``split_module`` makes of the traced model: ``submod_<even>`` are the pieces between
    attention ops, ``submod_<odd>`` the attention ops themselves."""
    if graph_id % 2:
        return silly_attention
    layer = graph_id // 2
    if layer == 0:
        def piece(input_ids, positions):
            return model.pre_attention(0, positions, model.embedding_tokens[input_ids], None)
    elif layer == NUM_LAYERS:
        def piece(attn_output, residual, positions):
            return model.post_attention(NUM_LAYERS - 1, attn_output, residual)[0]
    else:
        def piece(attn_output, residual, positions):
            hidden_states, residual = model.post_attention(layer - 1, attn_output, residual)
            return model.pre_attention(layer, positions, hidden_states, residual)
    return piece


# ------------------------------------------------------------------ vllm/compilation/backends.py
@dataclasses.dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: object


def split_graph(model, variant):
    names = [f"submod_{i}" for i in range(2 * NUM_LAYERS + 1)]
    if variant == "bug":
        # sort the names to make sure the order is deterministic
        names.sort()
    outputs = []
    for name in names:
        graph_id = int(name.replace("submod_", ""))
        outputs.append(SplitItem(name, graph_id, graph_id % 2 == 1, submodule(model, graph_id)))
    if variant == "fix":
        # sort by integer graph_id, rather than string name
        outputs.sort(key=lambda x: x.graph_id)
    return outputs


@dataclasses.dataclass
class ConcreteSizeEntry:
    runtime_shape: int
    use_cudagraph: bool
    runnable: object = None
    num_finished_warmup: int = 0
    cudagraph: object = None
    output: object = None


class PiecewiseBackend:
    def __init__(self, name, graph, graph_pool, variant, piecewise_compile_index, total_piecewise_compiles,
                 device, static_inputs):
        self.name, self.graph, self.graph_pool, self.variant = name, graph, graph_pool, variant
        self.device, self.static_inputs = device, static_inputs
        self.is_first_graph = piecewise_compile_index == 0
        self.is_last_graph = piecewise_compile_index == total_piecewise_compiles - 1
        self.first_run_finished = False
        self.concrete_size_entries = {s: ConcreteSizeEntry(s, True) for s in CAPTURE_SIZES}

    def __call__(self, *args):
        if not self.first_run_finished:
            self.first_run_finished = True
            return self.graph(*args)
        runtime_shape = args[-1].shape[0]              # positions: the symbolic num_tokens
        if runtime_shape not in self.concrete_size_entries:
            return self.graph(*args)
        entry = self.concrete_size_entries[runtime_shape]
        if entry.runnable is None:
            entry.runnable = self.graph
        if entry.cudagraph is None:
            if entry.num_finished_warmup < CUDAGRAPH_NUM_OF_WARMUPS:
                entry.num_finished_warmup += 1
                return entry.runnable(*args)

            def captured():
                # `output` is managed by pytorch's cudagraph pool
                output = entry.runnable(*args)
                if self.variant == "bug" or self.is_last_graph:
                    # by converting it to weak ref, the original `output` is released at once
                    output = weak_ref_tensors(output)
                return output

            cudagraph, output = capture(captured, device=self.device, pool=self.graph_pool, warmups=0,
                                        name=f"{self.name} size {runtime_shape}",
                                        owner=f"PiecewiseBackend {self.name}", static=self.static_inputs)
            entry.output = weak_ref_tensors(output)     # here we always use weak ref for the output
            entry.cudagraph = cudagraph
            if self.variant == "bug":
                return entry.output
            # important: return the output, rather than its weak ref, so that pytorch keeps it
            # alive while the next pieces are captured
            return output
        return replay(entry.cudagraph, entry.output)


class PiecewiseCompiledModel:
    """``VllmBackend`` + ``PiecewiseCompileInterpreter``: each non-splitting submodule gets a
    ``PiecewiseBackend``; the split module runs them, and the attention ops between them, in graph order."""

    def __init__(self, model, variant, device, input_ids, positions):
        items = split_graph(model, variant)
        compile_submod_names = [it.submod_name for it in items if not it.is_splitting_graph]
        graph_pool = graph_pool_handle(device)
        self.submods = {}
        for it in items:
            if it.is_splitting_graph:
                self.submods[it.graph_id] = it.graph
                continue
            static = {"positions": positions} | ({"input_ids": input_ids} if it.graph_id == 0 else {})
            self.submods[it.graph_id] = PiecewiseBackend(
                it.submod_name, it.graph, graph_pool, variant, compile_submod_names.index(it.submod_name),
                len(compile_submod_names), device, static)

    def forward(self, input_ids, positions):
        q, k, v, attn_output, residual = self.submods[0](input_ids, positions)
        for layer in range(1, NUM_LAYERS + 1):
            self.submods[2 * layer - 1](q, k, v, attn_output)
            out = self.submods[2 * layer](attn_output, residual, positions)
            q = k = v = attn_output = residual = None    # the split module drops a value after its last use
            if layer < NUM_LAYERS:
                q, k, v, attn_output, residual = out
        return out


class ModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device = model, device
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.forward = (PiecewiseCompiledModel(model, variant, device, self.input_ids, self.positions).forward
                        if graphed else model.forward)
        self.forward(self.input_ids, self.positions)                      # profile run (general shape)
        for size in reversed(CAPTURE_SIZES):                              # capture_model
            for _ in range(CUDAGRAPH_NUM_OF_WARMUPS + 1):
                self.forward(self.input_ids[:size], self.positions[:size])

    def execute_model(self, tokens, positions):
        n = len(tokens)
        self.input_ids[:n].copy_(torch.tensor(tokens, dtype=torch.long).to(self.device))
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long).to(self.device))
        return self.forward(self.input_ids[:n], self.positions[:n]).clone()


def run(variant: str, device: str = "cpu"):
    model = LlamaModel(device)

    def serve(graphed: bool):
        runner = ModelRunner(model, device, variant, graphed)
        return [runner.execute_model([3, 9, 1, 14], [0, 0, 0, 0]),
                runner.execute_model([5, 2], [1, 1]),
                runner.execute_model([7, 11, 4, 6], [1, 2, 1, 1])]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
