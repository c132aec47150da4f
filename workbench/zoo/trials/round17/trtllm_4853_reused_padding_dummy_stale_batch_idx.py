"""The CUDA-graph padding dummy, now reused every step, keeps a ``py_batch_idx`` and is taken for a real request.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/4853 ("fix: fix cuda graph padding for spec decoding").
Symptom: with the overlap scheduler and CUDA graph padding, generation after the padding change of #4729
"leads to an error"; the fix adds DeepSeek-V3-Lite ``test_fp8_block_scales_cuda_graph_padding`` tests
(MTP, attention DP) (TensorRT-LLM PyTorch backend, June 2025).
Mechanism: with the overlap scheduler a generation request's input token is the previous step's sampled
token, still on the device: ``_prepare_tp_inputs`` gathers ``new_tokens_device[previous_batch_indices]``
for every request whose ``py_batch_idx`` is set, and takes host tokens for the others. Dummy requests were
recognised by ``py_batch_idx is None`` ("skip dummy generation requests created in CUDA graph mode"),
which held while each padded step built fresh dummies. Since #4729 the runner pads with one dummy request
that is created once and reused for every padded batch, and ``_prepare_tp_inputs`` gives it a
``py_batch_idx`` like any request. The next padded step then treats the dummy as a request with a previous
tensor and gathers its token at a batch index from whichever earlier step last padded: when the previous
step was smaller (here a mixed context+generation step with no graph and no dummy), that row does not exist
and the gather reads out of bounds; the whole step fails.
Doctor: stale-padding, at ``_prepare_tp_inputs`` (the padded row's metadata, a batch index left from an
earlier step, decides what the step gathers).
Fix (upstream): identify dummies by ``request.is_dummy`` instead of ``py_batch_idx is None`` (and keep the
dummy extend requests at the end of ``extend_requests``), so the reused dummy always takes host inputs.
(Modelled on the plain generation path of ``_prepare_tp_inputs``, which carries the same check as the MTP
extend path the PR title names; the model is a one-token-in, one-token-out toy.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/4853"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "_prepare_tp_inputs"
SYMPTOM = "a padded generation step gathers the reused dummy's token at a stale batch index: out of bounds"
VOCAB, DIM, MAX_POS = 11, 4, 16
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4)
CUDA_GRAPH_DUMMY_REQUEST_ID = -1


class LlmRequest:
    def __init__(self, request_id, prompt, is_dummy=False):
        self.py_request_id = request_id
        self.tokens = list(prompt)
        self.is_dummy = is_dummy
        self.py_batch_idx = None

    @property
    def max_beam_num_tokens(self):
        return len(self.tokens)

    def get_last_tokens(self, beam=0):
        return self.tokens[-1]


class Model:
    def __init__(self, device):
        gen = generator(4853)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device)

    def forward(self, input_ids, position_ids):
        return torch.tanh(self.embed[input_ids] + self.pos_embed[position_ids]) @ self.lm_head


class PyTorchModelEngine:
    def __init__(self, model, device, variant, use_cuda_graph):
        self.model, self.device, self.variant = model, device, variant
        self.use_cuda_graph = use_cuda_graph
        self.input_ids_cuda = torch.zeros(max(CUDA_GRAPH_BATCH_SIZES), dtype=torch.long, device=device)
        self.position_ids_cuda = torch.zeros(max(CUDA_GRAPH_BATCH_SIZES), dtype=torch.long, device=device)
        self.previous_batch_indices_cuda = torch.zeros(max(CUDA_GRAPH_BATCH_SIZES), dtype=torch.long,
                                                       device=device)
        self.cuda_graph_dummy_request = None
        self._cuda_graphs = {}

    def _is_dummy(self, request):
        if self.variant == "fix":
            return request.is_dummy                # the fix
        return request.py_batch_idx is None        # before: "dummies have no batch index"

    def _prepare_tp_inputs(self, context_requests, generation_requests, new_tokens_device):
        input_ids, position_ids = [], []
        batch_idx = 0
        for request in context_requests:
            input_ids.append(request.get_last_tokens(0))
            position_ids.append(request.max_beam_num_tokens - 1)
            request.py_batch_idx = batch_idx
            batch_idx += 1
        previous_batch_indices = []
        for request in generation_requests:
            if new_tokens_device is None or self._is_dummy(request):
                input_ids.append(request.get_last_tokens(0))
                past_seen_token_num = request.max_beam_num_tokens - 1
            else:
                past_seen_token_num = request.max_beam_num_tokens
            position_ids.append(past_seen_token_num)
            # skip dummy generation requests created in CUDA graph mode
            if new_tokens_device is not None and not self._is_dummy(request):
                previous_batch_indices.append(request.py_batch_idx)
            request.py_batch_idx = batch_idx
            batch_idx += 1
        num_tokens, previous_batchs = len(input_ids), len(previous_batch_indices)
        if num_tokens > 0:
            host = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            if context_requests:
                self.input_ids_cuda[:num_tokens].copy_(host)
            else:
                self.input_ids_cuda[previous_batchs:previous_batchs + num_tokens].copy_(host)
        if previous_batchs > 0:
            self.previous_batch_indices_cuda[:previous_batchs].copy_(
                torch.tensor(previous_batch_indices, dtype=torch.long, device=self.device))
            gathered = new_tokens_device[self.previous_batch_indices_cuda[:previous_batchs]]
            if context_requests:
                self.input_ids_cuda[num_tokens:num_tokens + previous_batchs].copy_(gathered)
            else:
                self.input_ids_cuda[:previous_batchs].copy_(gathered)
        self.position_ids_cuda[:len(position_ids)].copy_(torch.tensor(position_ids, device=self.device))
        return len(position_ids)

    def _get_padded_batch(self, generation_requests):
        """Pad a generation-only batch to the next captured size with the one (reused) dummy request."""
        padded = min(s for s in CUDA_GRAPH_BATCH_SIZES if s >= len(generation_requests))
        if self.cuda_graph_dummy_request is None:
            self.cuda_graph_dummy_request = LlmRequest(CUDA_GRAPH_DUMMY_REQUEST_ID, [0], is_dummy=True)
        return generation_requests + [self.cuda_graph_dummy_request] * (padded - len(generation_requests))

    def warmup(self):
        for bs in CUDA_GRAPH_BATCH_SIZES:
            ids, pos = self.input_ids_cuda[:bs], self.position_ids_cuda[:bs]
            self._cuda_graphs[bs] = capture(lambda ids=ids, pos=pos: self.model.forward(ids, pos),
                                            device=self.device, name=f"size {bs}",
                                            static={"input_ids": self.input_ids_cuda,
                                                    "position_ids": self.position_ids_cuda},
                                            owner="PyTorchModelEngine (DecodingCUDAGraphRunner)")

    def forward(self, context_requests, generation_requests, new_tokens_device):
        real = len(context_requests) + len(generation_requests)
        if self.use_cuda_graph and not context_requests:
            generation_requests = self._get_padded_batch(generation_requests)
            n = self._prepare_tp_inputs(context_requests, generation_requests, new_tokens_device)
            g, out = self._cuda_graphs[n]
            return replay(g, out, real=real, size=n, padded={})
        n = self._prepare_tp_inputs(context_requests, generation_requests, new_tokens_device)
        return self.model.forward(self.input_ids_cuda[:n], self.position_ids_cuda[:n])


def run(variant: str, device: str = "cpu"):
    model = Model(device)

    def serve(graphed: bool):
        engine = PyTorchModelEngine(model, device, variant, graphed)
        if graphed:
            engine.warmup()
        A, B, C, D = (LlmRequest(i, p) for i, p in enumerate(([1, 2], [3], [4, 5, 6], [7, 8])))
        outs, new_tokens_device = [], None
        # (context requests, generation requests): C finishes after step 2, D arrives in step 3
        schedule = [([A, B, C], []), ([], [A, B, C]), ([D], [A, B]), ([], [A, B, D]), ([], [A, B, D])]
        for context, generation in schedule:
            logits = engine.forward(context, generation, new_tokens_device)
            real = len(context) + len(generation)
            outs.append(logits[:real].clone())
            # the sampler: tokens for every row of the step (padded rows too), kept on the device
            new_tokens_device = logits.argmax(-1).clone()
            # the overlap scheduler updates the host view one step late; the toy applies it now
            for row, request in enumerate(context + generation):
                request.tokens.append(int(new_tokens_device[row]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
