"""Megatron's layer-graph capture hands the language decoder's grad buffer to the vision encoder's last layer.

Upstream: https://github.com/NVIDIA/Megatron-LM/commit/603592a7fbd9a23b455a0fcef914dcf68a1b4f72
(ADLR/megatron-lm!3366, "Optimize dummy weight tensors for cudagraph and fix shape mismatch between vision and
language transformer", June 2025; a GitLab merge request mirrored as a commit, no GitHub PR).
Read: the commit's diff of ``megatron/core/transformer/cuda_graphs.py`` (``_CudagraphGlobalRecord.create_cudagraphs``,
``_CudaGraphRunner.create_bwd_graph``) and the unit test it adds (``TestLLaVACudaGraph.
test_llava_cudagraph_is_last_layer_logic``); the merge request's description is not public, so the symptom below
is the one that test and the fix's comment describe.
Symptom: a LLaVA model (CLIP ViT encoder + GPT decoder, both ``enable_cuda_graph=True``) records its layer
graphs during the first training step and then fails in ``create_cudagraphs()`` while capturing the vision
transformer's backward graphs: ``torch.autograd.grad`` raises "Mismatch in shape: grad_output[0] has a shape of
<language hidden> and output[0] has a shape of <vision hidden>".
Mechanism: with ``share_cudagraph_io_buffers`` every transformer layer's runner has ``reuse_input_output_buffer``
and ``create_cudagraphs`` chains the backward graphs in recorded (execution) order: each runner's
``create_bwd_graph(prev_bwd_hidden_state_inputgrad)`` takes the previous runner's ``static_grad_inputs[0]`` (the
hidden-state dgrad buffer) as its own ``static_grad_outputs``, and the chain variable is only left alone after
a last layer (``if not runner.is_last_layer: prev = runner.static_grad_inputs[0]``). ``is_first_layer`` /
``is_last_layer`` are per model (vision layers 1..N, language layers 1..M), and the backward order is the
language stack (last to first) then the vision stack. The language model's first layer leaves its dgrad buffer
(shape ``[s_lm, b, h_lm]``) in ``prev``, and the vision encoder's last layer, the next runner, captures its
backward with that buffer as the gradient of its ``[s_vit, b, h_vit]`` output: the incoming gradient does not
fit the static buffer it is handed, and the capture's ``torch.autograd.grad`` rejects the shape.
Doctor: undersized-buffer, at ``create_cudagraphs`` (it hands the vision encoder's last-layer backward graph a
static grad-output buffer shaped for the language decoder, too small for that layer's output gradient).
Fix (upstream): ``create_cudagraphs`` resets ``prev_bwd_hidden_state_inputgrad = None`` before
``create_bwd_graph`` whenever ``runner.is_last_layer``, so each model's last layer allocates its own
``zeros_like`` grad-output buffer (the commit also reworks the dummy wgrads returned with
``fuse_wgrad_accumulation``, not modelled).
"""
from __future__ import annotations

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/commit/603592a7fbd9a23b455a0fcef914dcf68a1b4f72"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "create_cudagraphs"
SYMPTOM = "create_cudagraphs fails on the ViT's last layer: its bwd graph gets the LM's smaller grad buffer"

NUM_LAYERS = 3                        # per transformer (vision and language)
S_VIT, H_VIT = 8, 6                   # vision: patches, hidden
S_TEXT, H_LM = 2, 4                   # language: text tokens, hidden
PATCH = 5                             # pixels per patch
S_LM = S_TEXT + S_VIT // 2            # text + image tokens (pixel shuffle halves the patches)
BATCH, STEPS, LR = 1, 4, 0.05


# --------------------------------------------------------------------------- the layers (explicit autograd)
class TransformerLayer:
    """A pre-norm-free stand-in for ``TransformerLayer``: ``h + tanh(h @ W + b)``, returning
    ``(hidden_states, context)`` like Megatron's layer; its backward is written out."""

    def __init__(self, layer_number, hidden, gen, device):
        self.layer_number = layer_number
        self.weight = randn(hidden, hidden, gen=gen, device=device, scale=0.4)
        self.bias = randn(hidden, gen=gen, device=device, scale=0.1)
        self.grads = [None, None]

    def parameters(self):
        return (self.weight, self.bias)

    def forward(self, hidden_states):
        act = torch.tanh(hidden_states @ self.weight + self.bias)
        return hidden_states + act, act                 # (output, the activation saved for backward)

    def backward(self, hidden_states, act, grad_output):
        """``torch.autograd.grad`` of the layer: (dgrad, wgrad, bgrad)."""
        grad_pre = grad_output * (1 - act * act)
        flat_h = hidden_states.reshape(-1, hidden_states.shape[-1])
        flat_g = grad_pre.reshape(-1, grad_pre.shape[-1])
        return grad_output + grad_pre @ self.weight.t(), flat_h.t() @ flat_g, flat_g.sum(0)


def autograd_grad(outputs, grad_outputs, backward):
    """``torch.autograd.grad(outputs=..., grad_outputs=...)``: its ``_make_grads`` check of every
    grad_output against its output, then the backward kernels."""
    for i, (out, grad) in enumerate(zip(outputs, grad_outputs)):
        if not torch.is_same_size(out, grad):
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of {grad.shape} and "
                               f"output[{i}] has a shape of {out.shape}.")
    return backward()


# ------------------------------------------------------------------------------- megatron cuda_graphs.py
class _CudagraphGlobalRecord:
    cudagraph_created = False
    cudagraph_record: list = []

    @classmethod
    def record_fwd_graph(cls, runner, args):
        cls.cudagraph_record.append((runner, "fwd", args))

    @classmethod
    def record_bwd_graph(cls, runner):
        cls.cudagraph_record.append((runner, "bwd"))

    @classmethod
    def create_cudagraphs(cls, variant):
        """Create the recorded graphs in the order they were recorded, chaining the io buffers."""
        optimize_transformer_layer_graph_buffers = all(g[0].reuse_input_output_buffer for g in cls.cudagraph_record)
        prev_fwd_hidden_state_output = None
        prev_bwd_hidden_state_inputgrad = None
        for g in cls.cudagraph_record:
            runner, graph_type = g[0:2]
            if optimize_transformer_layer_graph_buffers:
                if graph_type == "fwd":
                    hidden_states = g[2] if runner.is_first_layer else prev_fwd_hidden_state_output
                    runner.create_fwd_graph(hidden_states)
                    prev_fwd_hidden_state_output = runner.fwd_graph_outputs[0]
                else:
                    if variant == "fix" and runner.is_last_layer:
                        # vision and language transformers have different hidden shapes, and each has its
                        # own first and last layers: start a fresh buffer at every last layer
                        prev_bwd_hidden_state_inputgrad = None
                    runner.create_bwd_graph(prev_bwd_hidden_state_inputgrad)
                    # The first input grad TransformerLayer is for 'hidden_states'
                    if not runner.is_last_layer:
                        prev_bwd_hidden_state_inputgrad = runner.static_grad_inputs[0]
        for g in cls.cudagraph_record:
            g[0].cudagraph_created = True
        cls.cudagraph_created = True
        cls.cudagraph_record = []


class _CudaGraphRunner:
    def __init__(self, base_module, num_layers, pool, device):
        self.base_module, self.pool, self.device = base_module, pool, device
        self.reuse_input_output_buffer = True           # an LLM/ViT TransformerLayer, shared io buffers
        self.is_first_layer = (base_module.layer_number - 1) % num_layers == 0
        self.is_last_layer = base_module.layer_number % num_layers == 0
        self.fwd_graph_recorded = self.bwd_graph_recorded = self.cudagraph_created = False

    # ---- first step: eager, recording the order in which graphs are needed
    def record_graph_capture(self, hidden_states):
        if not self.fwd_graph_recorded:
            _CudagraphGlobalRecord.record_fwd_graph(self, hidden_states if self.is_first_layer else None)
            self.fwd_graph_recorded = True
        return self.base_module.forward(hidden_states)

    def record_bwd(self):
        """``_CudagraphRecordNode.backward``: the first bwd pass of this runner is recorded."""
        if not self.bwd_graph_recorded:
            _CudagraphGlobalRecord.record_bwd_graph(self)
            self.bwd_graph_recorded = True

    # ---- create_cudagraphs()
    def create_fwd_graph(self, hidden_states):
        self.fwd_graph_input = hidden_states            # clone_inputs=False: the recorded input itself
        module = self.base_module
        static = {"hidden_states": hidden_states} if self.is_first_layer else None
        self.fwd_graph, self.fwd_graph_outputs = capture(
            lambda: module.forward(self.fwd_graph_input), device=self.device, pool=self.pool, warmups=1,
            name=f"fwd L{module.layer_number} h{hidden_states.shape[-1]}", static=static,
            owner="_CudaGraphRunner (fwd graph)")

    def create_bwd_graph(self, static_grad_outputs=None):
        output, act = self.fwd_graph_outputs
        owned = static_grad_outputs is None
        if owned:
            static_grad_outputs = torch.zeros_like(output)
        self.static_grad_outputs = static_grad_outputs
        module = self.base_module
        self.bwd_graph, self.static_grad_inputs = capture(
            lambda: autograd_grad((output,), (self.static_grad_outputs,),
                                  lambda: module.backward(self.fwd_graph_input, act, self.static_grad_outputs)),
            device=self.device, pool=self.pool, warmups=0, name=f"bwd L{module.layer_number} h{output.shape[-1]}",
            static={"grad_output": static_grad_outputs} if owned else None, owner="_CudaGraphRunner (bwd graph)")

    # ---- later steps: _CudagraphReplayNode
    def replay_fwd(self, hidden_states):
        if hidden_states.data_ptr() != self.fwd_graph_input.data_ptr():
            self.fwd_graph_input.copy_(hidden_states)
        output, act = replay(self.fwd_graph, self.fwd_graph_outputs)
        # if last transformer layer, return a clone of the cudagraph output buffer
        return (output.clone() if self.is_last_layer else output), act

    def replay_bwd(self, grad_output):
        if grad_output.data_ptr() != self.static_grad_outputs.data_ptr():
            self.static_grad_outputs.copy_(grad_output)
        dgrad, wgrad, bgrad = replay(self.bwd_graph, self.static_grad_inputs)
        self.base_module.grads = [wgrad.clone(), bgrad.clone()]
        return dgrad.clone() if self.is_first_layer else dgrad


# ----------------------------------------------------------------------------------------- LLaVA-ish model
class LLaVAModel:
    def __init__(self, device, graphed, variant):
        gen = generator(603592)
        self.vision = [TransformerLayer(i + 1, H_VIT, gen, device) for i in range(NUM_LAYERS)]
        self.language = [TransformerLayer(i + 1, H_LM, gen, device) for i in range(NUM_LAYERS)]
        self.patch_embed = randn(PATCH, H_VIT, gen=gen, device=device, scale=0.5)
        self.projection = randn(2 * H_VIT, H_LM, gen=gen, device=device, scale=0.3)   # pixel shuffle + MLP
        self.graphed, self.variant, self.step = graphed, variant, 0
        if graphed:
            pool = graph_pool_handle(device)
            self.runners = {id(m): _CudaGraphRunner(m, NUM_LAYERS, pool, device) for m in self.vision + self.language}

    def layer_fwd(self, layer, hidden_states):
        if not self.graphed:
            return layer.forward(hidden_states)
        runner = self.runners[id(layer)]
        if runner.cudagraph_created:
            return runner.replay_fwd(hidden_states)
        return runner.record_graph_capture(hidden_states)

    def layer_bwd(self, layer, hidden_states, act, grad_output):
        if self.graphed and self.runners[id(layer)].cudagraph_created:
            return self.runners[id(layer)].replay_bwd(grad_output)
        if self.graphed:
            self.runners[id(layer)].record_bwd()
        dgrad, wgrad, bgrad = layer.backward(hidden_states, act, grad_output)
        layer.grads = [wgrad, bgrad]
        return dgrad

    def train_step(self, patches, text, target):
        saved = []
        h = patches @ self.patch_embed                            # patch embedding (eager), vision encoder
        for layer in self.vision:
            out, act = self.layer_fwd(layer, h)
            saved.append((layer, h, act))
            h = out
        shuffled = h.reshape(S_VIT // 2, BATCH, 2 * H_VIT)        # vision projection (eager)
        h = torch.cat([text, shuffled @ self.projection])
        for layer in self.language:                               # language decoder
            out, act = self.layer_fwd(layer, h)
            saved.append((layer, h, act))
            h = out
        loss = (h * target).sum()
        grad = target                                             # backward, in reverse order
        for layer, inp, act in reversed(saved[NUM_LAYERS:]):
            grad = self.layer_bwd(layer, inp, act, grad)
        grad_img = grad[S_TEXT:]
        grad_proj = shuffled.reshape(-1, 2 * H_VIT).t() @ grad_img.reshape(-1, H_LM)
        grad = (grad_img @ self.projection.t()).reshape(S_VIT, BATCH, H_VIT)
        for layer, inp, act in reversed(saved[:NUM_LAYERS]):
            grad = self.layer_bwd(layer, inp, act, grad)
        grad_embed = patches.reshape(-1, PATCH).t() @ grad.reshape(-1, H_VIT)
        grads = [g for layer in self.vision + self.language for g in layer.grads] + [grad_proj, grad_embed]
        outs = [loss.reshape(1)] + [g.clone() for g in grads]
        with torch.no_grad():                                     # optimizer step, in place
            for layer in self.vision + self.language:
                for p, g in zip(layer.parameters(), layer.grads):
                    p.sub_(LR * g)
            self.projection.sub_(LR * grad_proj)
            self.patch_embed.sub_(LR * grad_embed)
        return outs


def run(variant: str, device: str = "cpu"):
    gen = generator(6035920)
    batches = [(randn(S_VIT, BATCH, PATCH, gen=gen, device=device), randn(S_TEXT, BATCH, H_LM, gen=gen, device=device),
                randn(S_LM, BATCH, H_LM, gen=gen, device=device)) for _ in range(STEPS)]

    def workload(graphed):
        _CudagraphGlobalRecord.cudagraph_created = False
        _CudagraphGlobalRecord.cudagraph_record = []
        model = LLaVAModel(device, graphed, variant)
        outs = []
        for i, (patches, text, target) in enumerate(batches):
            if graphed and i == 0:
                with events.warmup(real=True):                    # the recording step runs eagerly
                    outs += model.train_step(patches, text, target)
                # forward_backward_* calls create_cudagraphs() at the end of the first step's schedule
                _CudagraphGlobalRecord.create_cudagraphs(variant)
            else:
                outs += model.train_step(patches, text, target)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: workload(True), lambda: workload(False))
