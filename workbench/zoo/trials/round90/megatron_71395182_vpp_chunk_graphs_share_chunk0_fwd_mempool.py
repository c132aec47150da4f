"""Local CUDA graphs under virtual pipeline parallelism: every model chunk takes chunk 0's per-microbatch forward mempool.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/71395182cd3d74c14ff9d87341c12b5da86307a5
("ADLR/megatron-lm!3824 - Fix cuda graph when VPP is used", NVIDIA/Megatron-LM, 2025-08-21). Read: the commit's
diff (megatron/core/transformer/cuda_graphs.py and transformer_layer.py) and, at its parent commit, the whole of
``cuda_graphs.py`` (``CudaGraphManager.__init__`` / ``get_cudagraph_runner``, ``_CudaGraphRunner``,
``_CudagraphGlobalRecord.create_cudagraphs``, ``_CudagraphReplayNode``) and ``parallel_state.py``
(``set_virtual_pipeline_model_parallel_rank`` warns "in global scope is deprecated. Pass vp_stage explicitly").
The commit has no description and no linked issue; the symptom below is derived from the code, not reported.
Symptom: training with Megatron's local CUDA graphs (``--cuda-graph-impl local``), pipeline parallelism and a
virtual pipeline (VPP > 1): after the first (recording) iteration the graphed layers of model chunk 1 replay their
backward against saved activations that chunk 0's forward replays have overwritten: wrong weight gradients and
input gradients, silently (eager is fine).
Mechanism: with PP > 1 ``CudaGraphManager`` keeps one forward mempool per (virtual pipeline rank, in-flight
microbatch slot): ``get_cudagraph_runner`` takes ``CudaGraphManager.fwd_mempools[vpp_rank][len(self.cudagraph_
runners)]``, so that the graphs sharing a pool are one chunk's graphs of one slot, which always run in the same
relative order. ``vpp_rank`` came from ``parallel_state.get_virtual_pipeline_model_parallel_rank()``, the global
VPP rank that the interleaved schedule no longer sets (it passes ``vp_stage`` explicitly; the global setter is
deprecated), so it is ``None`` -> 0 for every chunk: chunk 1's runners are captured into chunk 0's pools.
``create_cudagraphs`` captures in first-use order, so chunk 1's forward graph (captured after chunk 0's) is handed
the blocks chunk 0's forward capture freed (its temporaries): chunk 1's saved activation lands in the block of a
chunk-0 temporary. Once runners are reused, the schedule replays chunk 0's forward for a new microbatch between
chunk 1's forward and backward of an older one; that replay writes its temporary over chunk 1's saved
activation, which chunk 1's backward graph then reads.
Doctor: overwritten-output, at get_cudagraph_runner. The saved activation is an output of chunk 1's forward
graph, read by its backward replay after a replay of another graph (chunk 0's forward, same pool because the
pool was chosen from the unset global VPP rank) overwrote its memory.
Fix (upstream): ``CudaGraphManager`` gets the layer's own ``vp_stage`` (``TransformerLayer`` passes it) and
``get_cudagraph_runner`` picks ``fwd_mempools[self.vp_stage][...]``; ``_determine_if_first_last_layer_of_this_
vp_chunk`` likewise reads the VPP size from the config instead of ``parallel_state``.
Modelled: ``parallel_state`` (the unset global VPP rank), ``CudaGraphManager`` (per-slot forward pools, shared
backward pool, runner reuse by status), ``_CudaGraphRunner`` (record in the first iteration, ``create_fwd_graph``
/ ``create_bwd_graph`` captured in recorded order, replay with copy-in of inputs and grads), and
``_CudagraphGlobalRecord``. The layer is a stand-in for a TransformerLayer MLP block: ``h = x W1``,
``a = relu(h)`` (saved for backward), ``z = a W2``, ``y = x + z``; its backward accumulates ``main_grad``
(gradient-accumulation fusion). One layer per chunk (so each is first and last layer of its chunk: io buffers
are not shared, outputs and input grads are cloned); the other half of the fix (first/last-layer detection) is
not modelled. Hidden 8, 4 tokens per microbatch, float64.
Workload: one rank holding chunks 0 and 1, three microbatches per iteration, schedule F0m0 F1m0 F0m1 B1m0 B0m0
F1m1 F0m2 B1m1 B0m1 F1m2 B1m2 B0m2 (interleaved kind: a chunk-0 forward of a new microbatch between a chunk-1
forward and its backward), inputs and output grads given as if received from the neighbour stages. Iteration 1
records (eager) and captures; iterations 2-3 replay. With the bug F0m2 (chunk 0, runner 0) overwrites chunk 1
runner 0's saved ``relu`` output of m1, so B1m1's input grads and both main_grads differ from eager.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/71395182cd3d74c14ff9d87341c12b5da86307a5"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "get_cudagraph_runner"
SYMPTOM = ("local CUDA graphs with a virtual pipeline: chunk 1's graphs are captured into chunk 0's forward "
           "mempool (global VPP rank unset -> 0); a chunk-0 forward replay overwrites chunk 1's saved "
           "activation before its backward: wrong gradients")

HIDDEN, TOKENS = 8, 4
NUM_CHUNKS, NUM_MICROBATCHES, NUM_ITERATIONS = 2, 3, 3
SCHEDULE = [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 1, 0), ("B", 0, 0), ("F", 1, 1),
            ("F", 0, 2), ("B", 1, 1), ("B", 0, 1), ("F", 1, 2), ("B", 1, 2), ("B", 0, 2)]
FWD_READY, BWD_READY = "FWD_READY", "BWD_READY"

_variant = "bug"


class parallel_state:
    """megatron.core.parallel_state: the interleaved schedule passes vp_stage explicitly and no longer
    calls the (deprecated) global setter, so the global VPP rank stays unset."""
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None

    @staticmethod
    def get_virtual_pipeline_model_parallel_rank():
        return parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


class TransformerLayer:
    """Stand-in for the MLP half of a TransformerLayer, with gradient-accumulation fusion."""

    def __init__(self, layer_number, vp_stage, device, gen):
        self.layer_number, self.vp_stage = layer_number, vp_stage
        self.w1 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5).double()
        self.w2 = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5).double()
        self.w1_main_grad = torch.zeros_like(self.w1)
        self.w2_main_grad = torch.zeros_like(self.w2)

    def forward(self, x):
        h = x @ self.w1
        a = torch.relu(h)                 # saved for backward
        z = a @ self.w2
        return x + z, a

    def backward(self, x, a, grad_y):
        self.w2_main_grad.add_(a.t() @ grad_y)
        dh = (grad_y @ self.w2.t()) * (a > 0).to(a.dtype)
        self.w1_main_grad.add_(x.t() @ dh)
        return grad_y + dh @ self.w1.t()


class _CudagraphGlobalRecord:
    """First fwd/bwd use of every runner, in execution order: graphs are created in this order."""
    cudagraph_created = False
    cudagraph_record = []

    @classmethod
    def record_fwd_graph(cls, runner):
        cls.cudagraph_record.append((runner, "fwd"))

    @classmethod
    def record_bwd_graph(cls, runner):
        cls.cudagraph_record.append((runner, "bwd"))

    @classmethod
    def create_cudagraphs(cls):
        if cls.cudagraph_created or not cls.cudagraph_record:
            return
        for runner, graph_type in cls.cudagraph_record:
            if graph_type == "fwd":
                runner.create_fwd_graph()
            else:
                runner.create_bwd_graph()
        cls.cudagraph_created = True
        cls.cudagraph_record = []


class _CudaGraphRunner:
    """One fwd/bwd graph pair of one module for one in-flight microbatch."""

    def __init__(self, base_module, fwd_mempool, bwd_mempool, x, device):
        self.base_module, self.fwd_mempool, self.bwd_mempool = base_module, fwd_mempool, bwd_mempool
        self.device = device
        self.status = FWD_READY
        self.fwd_graph = self.bwd_graph = None
        self.fwd_graph_recorded = self.bwd_graph_recorded = False
        self.static_x = torch.zeros_like(x)                       # fwd graph input buffer
        self.static_grad_output = torch.zeros_like(x)             # bwd graph input buffer
        self.is_first_layer = self.is_last_layer = True           # io buffers not shared here
        self.eager_saved = None
        self.name = f"layer {base_module.layer_number} (vp {base_module.vp_stage})"

    # first iteration: run eagerly, record the order in which graphs are to be created
    def record_graph_capture(self, x):
        if not self.fwd_graph_recorded:
            _CudagraphGlobalRecord.record_fwd_graph(self)
            self.fwd_graph_recorded = True
        y, a = self.base_module.forward(x)
        self.eager_saved = (x, a)
        return y

    def record_bwd(self, grad_y):
        if not self.bwd_graph_recorded:
            _CudagraphGlobalRecord.record_bwd_graph(self)
            self.bwd_graph_recorded = True
        x, a = self.eager_saved
        self.eager_saved = None
        return self.base_module.backward(x, a, grad_y)

    def create_fwd_graph(self):
        m = self.base_module
        self.fwd_graph, self.fwd_graph_outputs = capture(
            lambda: m.forward(self.static_x), device=self.device, pool=self.fwd_mempool, warmups=1,
            name=f"fwd {self.name}", owner="CudaGraphManager", static={"hidden_states": self.static_x},
            state={"w1": m.w1, "w2": m.w2})

    def create_bwd_graph(self):
        m = self.base_module
        saved_a = self.fwd_graph_outputs[1]
        self.bwd_graph, self.bwd_graph_outputs = capture(
            lambda: m.backward(self.static_x, saved_a, self.static_grad_output), device=self.device,
            pool=self.bwd_mempool, warmups=0, name=f"bwd {self.name}", owner="CudaGraphManager",
            static={"grad_output": self.static_grad_output},
            state={"w1_main_grad": m.w1_main_grad, "w2_main_grad": m.w2_main_grad})

    # later iterations: _CudagraphReplayNode.forward / .backward
    def replay_fwd(self, x):
        assert self.status == FWD_READY
        if x.data_ptr() != self.static_x.data_ptr():
            self.static_x.copy_(x)
        y, _ = replay(self.fwd_graph, self.fwd_graph_outputs)
        return y.clone() if self.is_last_layer else y

    def replay_bwd(self, grad_y):
        self.static_grad_output.copy_(grad_y)
        dx = replay(self.bwd_graph, self.bwd_graph_outputs)
        self.status = FWD_READY
        return dx.clone() if self.is_first_layer else dx


class CudaGraphManager:
    fwd_mempools = None
    bwd_mempool = None

    def __init__(self, config, vp_stage, device):
        self.device = device
        self.vp_stage = vp_stage
        self.cudagraph_runners = []
        # PP > 1 and no single mempool: a forward mempool per (vpp rank, microbatch slot), one bwd pool
        if CudaGraphManager.fwd_mempools is None:
            CudaGraphManager.fwd_mempools = defaultdict(lambda: defaultdict(lambda: graph_pool_handle(device)))
            CudaGraphManager.bwd_mempool = graph_pool_handle(device)

    def get_cudagraph_runner(self, megatron_module, x):
        """Reuse a runner whose backward has run, else make one with the slot's forward mempool (hazard site)."""
        if _variant == "fix":
            vpp_rank = self.vp_stage if self.vp_stage is not None else 0
        else:
            vpp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
            vpp_rank = 0 if vpp_rank is None else vpp_rank
        fwd_mempool = CudaGraphManager.fwd_mempools[vpp_rank][len(self.cudagraph_runners)]
        bwd_mempool = CudaGraphManager.bwd_mempool
        runner = next((r for r in self.cudagraph_runners if r.status == FWD_READY), None)
        if runner is None:
            assert not _CudagraphGlobalRecord.cudagraph_created
            runner = _CudaGraphRunner(megatron_module, fwd_mempool, bwd_mempool, x, self.device)
            self.cudagraph_runners.append(runner)
        return runner

    def __call__(self, megatron_module, x):
        runner = self.get_cudagraph_runner(megatron_module, x)
        if _CudagraphGlobalRecord.cudagraph_created:
            out = runner.replay_fwd(x)
        else:
            out = runner.record_graph_capture(x)
        runner.status = BWD_READY
        return out, runner


def reset_global_state():
    CudaGraphManager.fwd_mempools = None
    CudaGraphManager.bwd_mempool = None
    _CudagraphGlobalRecord.cudagraph_created = False
    _CudagraphGlobalRecord.cudagraph_record = []


def train(device, use_cuda_graph):
    """Three iterations of the interleaved-kind schedule on one PP rank holding chunks 0 and 1."""
    reset_global_state()
    gen = generator(71395182)
    chunks = [TransformerLayer(layer_number=1 + 4 * c, vp_stage=c, device=device, gen=gen) for c in range(NUM_CHUNKS)]
    managers = [CudaGraphManager(config=None, vp_stage=c, device=device) for c in range(NUM_CHUNKS)]
    outputs = []
    for it in range(NUM_ITERATIONS):
        # received from the neighbour stages: chunk inputs (forward) and output grads (backward)
        inputs = {(c, mb): randn(TOKENS, HIDDEN, gen=gen, device=device).double()
                  for c in range(NUM_CHUNKS) for mb in range(NUM_MICROBATCHES)}
        grads = {(c, mb): randn(TOKENS, HIDDEN, gen=gen, device=device).double()
                 for c in range(NUM_CHUNKS) for mb in range(NUM_MICROBATCHES)}
        in_flight, eager_saved = {}, {}
        for kind, c, mb in SCHEDULE:
            layer = chunks[c]
            if kind == "F":
                if use_cuda_graph:
                    y, runner = managers[c](layer, inputs[c, mb])
                    in_flight[c, mb] = runner
                else:
                    y, a = layer.forward(inputs[c, mb])
                    eager_saved[c, mb] = (inputs[c, mb], a)
                outputs.append(y)
            else:
                if use_cuda_graph:
                    runner = in_flight.pop((c, mb))
                    if _CudagraphGlobalRecord.cudagraph_created:
                        dx = runner.replay_bwd(grads[c, mb])
                    else:
                        dx = runner.record_bwd(grads[c, mb])
                        runner.status = FWD_READY
                else:
                    x, a = eager_saved.pop((c, mb))
                    dx = layer.backward(x, a, grads[c, mb])
                outputs.append(dx)
        if use_cuda_graph and it == 0:
            _CudagraphGlobalRecord.create_cudagraphs()     # end of the first schedule call
        outputs += [layer.w1_main_grad.clone() for layer in chunks] + [layer.w2_main_grad.clone() for layer in chunks]
    reset_global_state()
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: train(device, use_cuda_graph=True), lambda: train(device, use_cuda_graph=False))
