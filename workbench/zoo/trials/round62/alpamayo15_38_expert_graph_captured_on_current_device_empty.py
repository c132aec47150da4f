"""The expert graph is captured on the current device, not the expert's: it is empty; replays return stale output.

Upstream: https://github.com/NVlabs/alpamayo1.5/pull/38 ("Fix CUDA graph capture on non-current device", merged
2026-09; a follow-up to #36 "Reduce diffusion-expert launch overhead with bounded CUDA graphs", mirrored in
NVlabs/alpamayo2#12).
Symptom: with the expert on ``cuda:1`` while the process's current device is ``cuda:0``, "That can produce an empty
graph, so replay returns stale static output instead of executing the expert"; in the Alpamayo 2 real-model repro
"baseline output diverged; fixed capture/replay matched eager output exactly".
Mechanism: ``enable_diffusion_expert_cuda_graph(expert, max_batch_size, max_graphs)`` installs
``DiffusionExpertCudaGraph.forward``; for each exact input/prompt-KV signature ``_capture`` allocates static buffers
(``static_inputs``, ``static_position_ids``, ``static_attention_mask``, ``prompt_keys``/``prompt_values`` behind
``_ReadOnlyPromptCacheLayer``, zero-filled), warms ``static_forward`` up three times on
``torch.cuda.Stream(device=parameter.device)``, then does ``graph = torch.cuda.CUDAGraph()`` and
``with torch.cuda.graph(graph, capture_error_mode="thread_local"): static_output = static_forward()``. Both inherit
the current device (``cuda:0``): ``torch.cuda.graph`` makes its capture stream current on ``cuda:0`` only, while
every kernel of the expert (its tensors are on ``cuda:1``) goes to ``cuda:1``'s current stream, which is not
capturing. The forward executes once, eagerly, during the capture (on the zero-filled static buffers) and the graph
records nothing. ``_GraphEntry.replay`` copies each flow-matching step's ``inputs_embeds``/``position_ids``/
``attention_mask`` (and the prompt K/V) into the static buffers and replays an empty graph, so ``self.output``
keeps the capture-time hidden states and every denoising step gets the same velocity. A kernel issued on another
device's (non-capturing) stream is modelled as a launch from another thread, whose stream no capture records (the
CPU engine records the capturing thread only); ``_Cuda`` holds the current device and the capture's device.
Doctor: host-work-frozen, at ``_capture`` (the expert's kernels ran once, outside the graph, during capture; the
replays repeat only what was recorded -- nothing -- so the static output stays at its capture-time value).
Fix (upstream): graph creation, capture and replay are bound to the expert's device with scoped
``torch.cuda.device(expert_device)`` contexts (capture on the explicit warmup stream), restoring the caller's
current device afterwards; regression ``test_cuda_graph_uses_expert_device_when_another_device_is_current``.
(Read: the PR description, the pre-fix ``diffusion_expert_cuda_graph.py`` of #36 and the post-fix test file; the
runner's post-fix diff was not in the stored snapshot.)
"""
from __future__ import annotations

import contextlib
import threading

import torch

from workbench.engine import is_capturing
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVlabs/alpamayo1.5/pull/38"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "_capture"
SYMPTOM = "replay of an empty expert graph returns the capture-time hidden states at every denoising step"

BATCH, SEQ, PROMPT, HIDDEN, STEPS = 2, 3, 5, 4, 4
EXPERT_DEVICE = 1        # the expert lives on cuda:1 ...
CALLER_DEVICE = 0        # ... while the process's current device is cuda:0


class _Cuda:
    """The process's CUDA state in miniature: ``torch.cuda.current_device()`` and the device whose current stream an
    open ``torch.cuda.graph`` capture made its capture stream."""

    current_device = CALLER_DEVICE
    capture_device: int | None = None


@contextlib.contextmanager
def cuda_device(index: int):
    """``torch.cuda.device(index)``: scoped; the caller's current device comes back afterwards."""
    previous, _Cuda.current_device = _Cuda.current_device, index
    try:
        yield
    finally:
        _Cuda.current_device = previous


@contextlib.contextmanager
def cuda_graph_stream():
    """What ``torch.cuda.graph`` does with streams: its capture stream is made current on the current device only."""
    _Cuda.capture_device = _Cuda.current_device
    try:
        yield
    finally:
        _Cuda.capture_device = None


def launch(device_index: int, kernels):
    """Kernels on tensors of ``cuda:<device_index>`` go to that device's current stream. If a capture is open on
    another device's stream, this one is not capturing: the kernels execute now and join no graph (modelled as
    another thread's stream)."""
    if not is_capturing() or device_index == _Cuda.capture_device:
        return kernels()
    result = []
    worker = threading.Thread(target=lambda: result.append(kernels()))
    worker.start()
    worker.join()
    return result[0]


class _ReadOnlyPromptCacheLayer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def update(self, key_states, value_states):
        return torch.cat((self.keys, key_states), dim=-2), torch.cat((self.values, value_states), dim=-2)


class DiffusionExpert:
    """One attention layer over the prompt K/V plus the action tokens (on ``cuda:1``)."""

    def __init__(self, device):
        gen = generator(38)
        self.device_index = EXPERT_DEVICE
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
                                              for _ in range(4))
        self.pos_scale = randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.forward = self.original_forward

    def original_forward(self, inputs_embeds, position_ids, attention_mask, past_key_values):
        q = inputs_embeds @ self.wq
        k, v = past_key_values.update(inputs_embeds @ self.wk, inputs_embeds @ self.wv)
        scores = q @ k.transpose(-1, -2) * HIDDEN ** -0.5 + attention_mask
        h = torch.softmax(scores, -1) @ v + position_ids[..., None].to(q.dtype) * self.pos_scale
        return (h @ self.wo).tanh()


class _GraphEntry:
    def __init__(self, variant, graph, output, inputs_embeds, position_ids, attention_mask, keys, values):
        self.variant, self.graph, self.output = variant, graph, output
        self.inputs_embeds, self.position_ids, self.attention_mask = inputs_embeds, position_ids, attention_mask
        self.prompt_keys, self.prompt_values = keys, values
        self.loaded_prompt_cache = None

    def replay(self, inputs_embeds, position_ids, attention_mask, prompt_cache):
        self.inputs_embeds.copy_(inputs_embeds)
        self.position_ids.copy_(position_ids)
        self.attention_mask.copy_(attention_mask)
        if self.loaded_prompt_cache is not prompt_cache:
            self.prompt_keys.copy_(prompt_cache.keys)
            self.prompt_values.copy_(prompt_cache.values)
            self.loaded_prompt_cache = prompt_cache
        scope = cuda_device(EXPERT_DEVICE) if self.variant == "fix" else contextlib.nullcontext()
        with scope:                                        # fix: replay on the expert's device
            return replay(self.graph, self.output)


class DiffusionExpertCudaGraph:
    def __init__(self, expert, variant, device, max_graphs=4):
        self.expert, self.variant, self.device, self.max_graphs = expert, variant, device, max_graphs
        self._original_forward = expert.forward
        self._graphs: dict[tuple, _GraphEntry] = {}

    @contextlib.contextmanager
    def sampling(self):
        for entry in self._graphs.values():
            entry.loaded_prompt_cache = None
        yield

    def forward(self, inputs_embeds, position_ids, attention_mask, past_key_values):
        signature = (tuple(inputs_embeds.shape), tuple(past_key_values.keys.shape))
        entry = self._graphs.get(signature)
        if entry is None:
            entry = self._graphs[signature] = self._capture(inputs_embeds, position_ids, attention_mask,
                                                            past_key_values)
        return entry.replay(inputs_embeds, position_ids, attention_mask, past_key_values)

    def _capture(self, inputs_embeds, position_ids, attention_mask, prompt_cache):
        keys, values = torch.zeros_like(prompt_cache.keys), torch.zeros_like(prompt_cache.values)
        static_inputs = torch.zeros_like(inputs_embeds)
        static_position_ids = torch.zeros_like(position_ids)
        static_attention_mask = torch.zeros_like(attention_mask)
        static_prompt_cache = _ReadOnlyPromptCacheLayer(keys, values)

        def static_forward():
            return launch(self.expert.device_index, lambda: self._original_forward(
                static_inputs, static_position_ids, static_attention_mask, static_prompt_cache))

        # warmup_stream = torch.cuda.Stream(device=parameter.device): three eager runs there, then
        # graph = torch.cuda.CUDAGraph(); with torch.cuda.graph(graph, ...): static_output = static_forward()
        scope = cuda_device(self.expert.device_index) if self.variant == "fix" else contextlib.nullcontext()
        with scope, cuda_graph_stream():                     # fix: torch.cuda.device(expert_device) around it
            graph, static_output = capture(
                static_forward, device=self.device, warmups=3, name=f"expert batch {inputs_embeds.shape[0]}",
                owner="DiffusionExpertCudaGraph",
                static={"inputs_embeds": static_inputs, "position_ids": static_position_ids,
                        "attention_mask": static_attention_mask, "prompt_keys": keys, "prompt_values": values})
        return _GraphEntry(self.variant, graph, static_output, static_inputs, static_position_ids,
                           static_attention_mask, keys, values)


def enable_diffusion_expert_cuda_graph(expert, variant, device, max_graphs=4):
    runner = DiffusionExpertCudaGraph(expert, variant, device, max_graphs)
    expert.forward = runner.forward
    return runner


def run(variant: str, device: str = "cpu"):
    gen = generator(3638)
    requests = []
    for value in (0.5, -1.0):                   # two trajectory-sampling requests, each its own prompt K/V
        prompt = _ReadOnlyPromptCacheLayer(randn(BATCH, PROMPT, HIDDEN, gen=gen, device=device),
                                           randn(BATCH, PROMPT, HIDDEN, gen=gen, device=device))
        noise = randn(BATCH, SEQ, HIDDEN, gen=gen, device=device) + value
        requests.append((prompt, noise))
    position_ids = (torch.arange(PROMPT, PROMPT + SEQ).expand(BATCH, SEQ)).to(device)
    attention_mask = torch.zeros(BATCH, SEQ, PROMPT + SEQ, device=device)

    def sample(expert, runner):
        """Flow matching: x <- x + dt * v(x), one expert forward per denoising step."""
        outs = []
        for prompt, noise in requests:
            x = noise.clone()
            with runner.sampling() if runner else contextlib.nullcontext():
                for _ in range(STEPS):
                    v = expert.forward(x, position_ids, attention_mask, prompt).clone()
                    x = x + v / STEPS
                    outs.append(v)
            outs.append(x)
        return outs

    def served():
        _Cuda.current_device = CALLER_DEVICE
        expert = DiffusionExpert(device)
        runner = enable_diffusion_expert_cuda_graph(expert, variant, device)
        outs = sample(expert, runner)
        assert _Cuda.current_device == CALLER_DEVICE           # the caller's current device is preserved
        return outs

    def eager():
        expert = DiffusionExpert(device)
        return sample(expert, None)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
