"""The step that captures a new LoRA decode graph replays it with every adapter id zeroed.

Upstream: https://github.com/InternLM/lmdeploy/pull/2466 ("Refactor lora"; its commit "fix adapter id fill
zero" changes ``CudaGraphMixin.update_context_cudagraph``).
Symptom: PyTorch engine with LoRA adapters and CUDA graphs (lmdeploy main, September 2024, right after the
``CudaGraphMixin`` refactor #2485): the first decode step served by each newly captured graph size generates
its token as if every request used adapter slot 0; the following steps, and eager mode, use the right
adapters.
Mechanism: ``CUDAGraphRunner.__call__`` captures a graph the first time a key (the padded token count) is
seen, and then serves the *same* step with ``runner.forward``. Both ``capture`` and ``forward`` call
``update_context_cudagraph``, which copies ``context.local_adapter_ids`` into the static
``input_buffers['local_adapter_ids']`` and then rebinds ``context.local_adapter_ids`` to that buffer. In
``forward`` the context's adapter ids therefore already *are* the static buffer, and the unconditional
``input_buffers['local_adapter_ids'].fill_(0)`` erases them before they are copied onto themselves: the replay
reads adapter 0 for every row. The neighbouring ``q_seqlens``/``kv_seqlens`` refreshes already guarded
against this aliasing with a ``data_ptr()`` check; the adapter ids did not.
Doctor: warmup-divergence, at ``update_context_cudagraph`` (the capture rebound the step's adapter-id
tensor to the static buffer; the replay of the same step then refreshes the buffer from that reference).
Fix (upstream): only zero the buffer when the context's adapter ids are a different tensor
(``if input_buffers['local_adapter_ids'].data_ptr() != local_adapter_ids.data_ptr(): ...fill_(0)``).
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/InternLM/lmdeploy/pull/2466"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "update_context_cudagraph"
SYMPTOM = "the step that captures a graph size decodes every request with adapter slot 0"
VOCAB, DIM, RANK, NUM_ADAPTERS = 12, 4, 2, 3


def next_power_of_2(n: int):
    return 1 << (n - 1).bit_length()


class StepContext:
    """The per-step context (``model_inputs.StepContext``): a new one every forward."""

    def __init__(self, local_adapter_ids, q_seqlens, kv_seqlens):
        self.is_decoding = True
        self.local_adapter_ids = local_adapter_ids
        self.q_seqlens = q_seqlens
        self.kv_seqlens = kv_seqlens


class StepContextManager:
    def __init__(self):
        self._current = None

    def set_context(self, context):
        self._current = context

    def current_context(self):
        return self._current


class CudaGraphMeta:
    def __init__(self, max_batchs, max_tokens, device):
        self.max_batchs, self.max_tokens, self.device = max_batchs, max_tokens, device
        self.input_buffers, self.output_buffers = {}, {}


class LlamaForCausalLM:
    """A one-layer decoder whose projection carries per-request LoRA (``LoRA`` linear, ``local_adapter_ids``)."""

    def __init__(self, ctx_mgr, variant, device):
        self.ctx_mgr, self.variant = ctx_mgr, variant
        gen = generator(2466)
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(32, DIM, gen=gen, device=device, scale=0.3)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.lora_a = randn(NUM_ADAPTERS, DIM, RANK, gen=gen, device=device, scale=0.8)
        self.lora_b = randn(NUM_ADAPTERS, RANK, DIM, gen=gen, device=device, scale=0.8)
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def __call__(self, input_ids, position_ids, **kwargs):
        context = self.ctx_mgr.current_context()
        num_tokens = input_ids.size(-1)
        adapter_ids = context.local_adapter_ids[:num_tokens]         # one token a sequence when decoding
        h = self.embed[input_ids[0]] + self.pos_embed[position_ids[0]]
        lora = torch.einsum("td,tdr,tre->te", h, self.lora_a[adapter_ids], self.lora_b[adapter_ids])
        h = h + torch.tanh(h @ self.w + lora)
        return h @ self.lm_head

    # --- CudaGraphMixin (lmdeploy/pytorch/models/utils/cudagraph.py) ---
    def make_buffers_cudagraph(self, graph_meta):
        max_batches, max_tokens, device = graph_meta.max_batchs, graph_meta.max_tokens, graph_meta.device
        input_buffers = dict()
        input_buffers['input_ids'] = torch.zeros(1, max_tokens, dtype=torch.int64, device=device)
        input_buffers['position_ids'] = torch.zeros(1, max_tokens, dtype=torch.int64, device=device)
        input_buffers['q_seqlens'] = torch.zeros(max_batches, dtype=torch.int64, device=device)
        input_buffers['kv_seqlens'] = torch.zeros(max_batches, dtype=torch.int64, device=device)
        input_buffers['local_adapter_ids'] = torch.zeros(max_batches, dtype=torch.int64, device=device)
        return input_buffers

    def fill_buffers_cudagraph(self, graph_meta, input_ids, position_ids, q_seqlens, kv_seqlens):
        input_buffers = graph_meta.input_buffers
        batch_size, num_tokens = q_seqlens.size(0), input_ids.size(-1)
        input_buffers['input_ids'][:, :num_tokens] = input_ids
        input_buffers['position_ids'][:, :num_tokens] = position_ids
        if q_seqlens.data_ptr() != input_buffers['q_seqlens'].data_ptr():
            input_buffers['q_seqlens'].zero_()
        input_buffers['q_seqlens'][:batch_size] = q_seqlens
        if kv_seqlens.data_ptr() != input_buffers['kv_seqlens'].data_ptr():
            input_buffers['kv_seqlens'].zero_()
        input_buffers['kv_seqlens'][:batch_size] = kv_seqlens
        return dict(input_ids=input_buffers['input_ids'], position_ids=input_buffers['position_ids'])

    def update_context_cudagraph(self, graph_meta, context):
        """Update step context with input buffers."""
        input_buffers = graph_meta.input_buffers
        local_adapter_ids = context.local_adapter_ids
        if local_adapter_ids is not None:
            if self.variant == "fix":
                if input_buffers['local_adapter_ids'].data_ptr() != local_adapter_ids.data_ptr():
                    input_buffers['local_adapter_ids'].fill_(0)
            else:
                input_buffers['local_adapter_ids'].fill_(0)
            batch_size = local_adapter_ids.size(0)
            input_buffers['local_adapter_ids'][:batch_size] = local_adapter_ids
            context.local_adapter_ids = input_buffers['local_adapter_ids']
        context.q_seqlens = input_buffers['q_seqlens']
        context.kv_seqlens = input_buffers['kv_seqlens']


class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, pool, device):
        self.model, self.ctx_mgr, self.pool, self.device = model, model.ctx_mgr, pool, device
        self.meta = CudaGraphMeta(max_batches, max_tokens, device)
        self._graph = None

    def capture(self, **kwargs):
        """Capture graph."""
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        context = self.ctx_mgr.current_context()
        self.model.update_context_cudagraph(self.meta, context)
        self._graph, output = capture(lambda: self.model(**padded_kwargs), device=self.device, pool=self.pool,
                                      warmups=1, name=f"decode tokens={self.meta.max_tokens}",
                                      static=self.meta.input_buffers, owner="CUDAGraphRunner")
        self.meta.output_buffers = dict(logits=output)
        return output

    def forward(self, **kwargs):
        num_tokens = kwargs['input_ids'].size(-1)
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        context = self.ctx_mgr.current_context()
        self.model.update_context_cudagraph(self.meta, context)
        logits = replay(self._graph, self.meta.output_buffers['logits'], real=num_tokens,
                        size=self.meta.max_tokens)
        return logits[:num_tokens]


class CUDAGraphRunner:
    """``lmdeploy/pytorch/backends/cuda/graph_runner.py``: a graph per padded size, captured on first use."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.graph_pool_handle = graph_pool_handle(device)
        self._runner_map = dict()

    def __call__(self, **kwargs):
        max_tokens = next_power_of_2(kwargs['input_ids'].numel())
        graph_key = (max_tokens, True)
        if graph_key not in self._runner_map:
            runner = CUDASingleGraphRunner(self.model, max_batches=max_tokens, max_tokens=max_tokens,
                                           pool=self.graph_pool_handle, device=self.device)
            runner.capture(**kwargs)
            self._runner_map[graph_key] = runner
        else:
            runner = self._runner_map[graph_key]
        return runner.forward(**kwargs)


def run(variant: str, device: str = "cpu"):
    # three LoRA requests (adapters 1, 2, 1) decode together, then one finishes (adapters 1, 2)
    schedule = [([3, 7, 5], [6, 4, 9], [1, 2, 1]), ([8, 2, 11], [7, 5, 10], [1, 2, 1]),
                ([4, 6], [8, 6], [1, 2])]

    def serve(graphed: bool):
        ctx_mgr = StepContextManager()
        model = LlamaForCausalLM(ctx_mgr, variant, device)
        runner = CUDAGraphRunner(model, device) if graphed else None
        outs = []
        for ids, pos, adapters in schedule:
            batch = len(ids)
            input_ids = torch.tensor([ids], device=device)
            position_ids = torch.tensor([pos], device=device)
            q_seqlens = torch.ones(batch, dtype=torch.long, device=device)
            kv_seqlens = position_ids[0] + 1
            ctx_mgr.set_context(StepContext(torch.tensor(adapters, device=device), q_seqlens, kv_seqlens))
            kwargs = dict(input_ids=input_ids, position_ids=position_ids, q_seqlens=q_seqlens,
                          kv_seqlens=kv_seqlens)
            logits = runner(**kwargs) if graphed else model(input_ids, position_ids)
            outs.append(logits.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
