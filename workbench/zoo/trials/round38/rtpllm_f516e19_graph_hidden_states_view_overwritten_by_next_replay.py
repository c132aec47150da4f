"""PyWrappedModel's CUDA-graph path returns a view of the graph runner's shared hidden-state buffer, which the next replay overwrites.

Upstream: https://github.com/alibaba/rtp-llm/commit/f516e19d794412011256a30d6714a3b123301703 ("fix: fix cuda graph
hidden"; a direct commit on main, no PR number).
Symptom: none stated in the commit (one-line fix). The hidden states a forward returns are kept past the forward:
``callForwardPostLayers`` puts them in ``GptModelOutputs.all_hidden_states``, the batch processor hands each
stream a slice of them, and ``NormalGenerateStream::updateOutput`` keeps that slice as ``last_hidden_states_``,
which the MTP propose executor (``MTPBatchStreamProcessor``) reads for the next draft step. Under CUDA graphs
those are the numbers of a later forward, so draft tokens are proposed from the wrong hidden states (wrong
drafts, lower acceptance).
Mechanism: ``CudaGraphRunner::forward`` replays the graph for the padded batch size and returns
``graph_instances_[bs].mem_hold_.decoder_layer_hidden_states_.slice(0, 0, seq_len_sum)``; every graph instance's
``mem_hold_`` is a slice of the one ``capture_mem_hold_.decoder_layer_hidden_states_`` buffer, into which each
captured forward copies its result. ``PyWrappedModel::forward`` wrapped that tensor with
``torchTensor2Buffer`` (no copy) on the graph path, while its eager path already ``clone``s. So every
``last_hidden_states_`` slice aliases the shared graph buffer, and the next ``graph_runner_->forward`` (any batch
size) overwrites it before the stream's propose reads it. Modelled consumer: the score phase runs the running
streams in two target forwards (the second for the streams past the first batch), then proposes for all of them,
so the first batch's kept hidden states are read after the second forward's replay.
Doctor: overwritten-output, at forward (``PyWrappedModel.forward`` hands out the graph-owned hidden states that
the next replay overwrites, without a copy).
Fix (upstream): the graph path also clones: ``hidden_states = device_->clone({*torchTensor2Buffer(
py_model_outputs.hidden_states)})``.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/f516e19d794412011256a30d6714a3b123301703"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "forward"
SYMPTOM = "MTP drafts are proposed from another batch's hidden states kept as a view of the graph's output buffer"

VOCAB, DIM, CAPTURE_BS, STEPS = 16, 4, (1, 2), 3
MAX_BS = max(CAPTURE_BS)


class TargetPyModel:
    """The Python model behind ``py_forward_method_``: decoder hidden states for the combo tokens."""

    def __init__(self, device):
        gen = generator(51619)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)
        self.mtp_fc = randn(DIM, DIM, gen=gen, device=device, scale=0.7)

    def forward(self, input_ids):
        return torch.tanh(self.embed[input_ids] @ self.w)


class CudaGraphRunner:
    def __init__(self, py_model, device):
        self.py_model = py_model
        self.input_ids = torch.zeros(MAX_BS, dtype=torch.long, device=device)
        # capture_mem_hold_: one hidden-state buffer; each graph instance's mem_hold_ is a slice of it.
        self.decoder_layer_hidden_states_ = torch.zeros(MAX_BS, DIM, device=device)
        self.graph_instances_ = {}
        for bs in CAPTURE_BS:
            self.graph_instances_[bs] = self._capture_one(bs, device)

    def _capture_one(self, bs, device):
        mem_hold = self.decoder_layer_hidden_states_[:bs]

        def py_forward():
            mem_hold.copy_(self.py_model.forward(self.input_ids[:bs]))
            return mem_hold
        return capture(py_forward, device=device, owner="CudaGraphRunner (decode graph)",
                       static={"input_ids": self.input_ids})

    def forward(self, input_ids):
        n = input_ids.shape[0]
        bs = min(b for b in CAPTURE_BS if b >= n)            # current_real_graph_bs
        self.input_ids[:n].copy_(input_ids)                  # prepareInputs
        self.input_ids[n:].fill_(0)
        graph, mem_hold = self.graph_instances_[bs]
        hidden = replay(graph, mem_hold, real=n, size=bs)
        return hidden[:n]                                    # mem_hold_.decoder_layer_hidden_states_.slice(0, 0, n)


class PyWrappedModel:
    def __init__(self, py_model, device, variant, enable_cuda_graph):
        self.py_model, self.variant, self.enable_cuda_graph_ = py_model, variant, enable_cuda_graph
        self.graph_runner_ = CudaGraphRunner(py_model, device) if enable_cuda_graph else None

    def forward(self, input_ids):
        if self.enable_cuda_graph_:
            hidden_states = self.graph_runner_.forward(input_ids)
            if self.variant == "fix":
                hidden_states = hidden_states.clone()        # device_->clone({*torchTensor2Buffer(...)})
        else:
            hidden_states = self.py_model.forward(input_ids).clone()
        return self.callForwardPostLayers(hidden_states)

    def callForwardPostLayers(self, hidden_states):
        return {"logits": hidden_states @ self.py_model.lm_head, "all_hidden_states": hidden_states}


class Stream:
    def __init__(self, token):
        self.token, self.last_hidden_states_ = token, None


def dispatch(streams, model_output):
    """NormalBatchStreamProcessor::dispatch + updateOutput: each stream's next token and its hidden-state slice."""
    for i, stream in enumerate(streams):
        stream.token = int(model_output["logits"][i].argmax())
        stream.last_hidden_states_ = model_output["all_hidden_states"][i:i + 1]   # slice sharing its parent


def mtp_propose(py_model, streams):
    """The MTP draft's first step for every stream, from its kept last_hidden_states_ and its new token."""
    hidden = torch.cat([s.last_hidden_states_ for s in streams])
    ids = torch.tensor([s.token for s in streams], device=hidden.device)
    return torch.tanh(hidden @ py_model.mtp_fc + py_model.embed[ids]) @ py_model.lm_head


def run(variant: str, device: str = "cpu"):
    py_model = TargetPyModel(device)

    def serve(graphed: bool):
        model = PyWrappedModel(py_model, device, variant, enable_cuda_graph=graphed)
        streams = [Stream(t) for t in (3, 7, 11)]
        outs = []
        for _ in range(STEPS):
            # Score phase: the first MAX_BS streams, then the rest, each one target forward.
            for group in (streams[:MAX_BS], streams[MAX_BS:]):
                ids = torch.tensor([s.token for s in group], device=device)
                out = model.forward(ids)
                outs.append(out["logits"].clone())
                dispatch(group, out)
            # Propose phase: the draft reads every stream's kept hidden states.
            outs.append(mtp_propose(py_model, streams).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
