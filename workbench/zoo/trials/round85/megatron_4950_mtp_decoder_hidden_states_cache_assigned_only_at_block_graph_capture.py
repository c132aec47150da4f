"""Megatron dynamic inference, MTP speculative decoding under block-scope (whole-model) CUDA graphs: the decoder hidden states reach the serial MTP step through a Python attribute assignment inside the captured ``forward``, which only ran at capture.

Upstream: https://github.com/NVIDIA/Megatron-LM/pull/4950 ("Add full model cuda graph support for MTP inference",
Keshav Santhanam, merged to main as commit 1cfa834a8dfa on 2026-06-16). Read: the full diff of
``megatron/core/inference/contexts/dynamic_context.py``, ``text_generation_controller.py``,
``megatron/core/models/gpt/gpt_model.py`` and ``megatron/core/models/hybrid/hybrid_model.py``, the new
``TestMTPBlockScopeCudaGraph`` tests, and, at the parent commit, ``HybridModel.forward``,
``TextGenerationController._compute_serial_mtp_and_sample`` / ``_sample_from_logits_2d`` and
``DynamicInferenceEngine.create_cuda_graphs``. The PR has no description beyond its title; it is titled as adding
support, but at the parent commit ``inference_cuda_graph_scope='block'`` with ``num_speculative_tokens > 0`` was
accepted by the config checks and ran the broken hand-off modelled here.
Symptom: MTP speculative decoding with whole-model CUDA graphs: the first graph-served decode step has no decoder
hidden states for the serial MTP step; on a single pipeline stage ``_sample_from_logits_2d(None)`` raises
``AttributeError: 'NoneType' object has no attribute 'shape'`` (had a decode replay come before any deletion, it
would have read the tensor left by the last capture, which only that one graph's replays rewrite).
Mechanism: ``HybridModel.forward`` (and ``GPTModel.forward``) ends, in inference with MTP, with
``self._decoder_hidden_states_cache = hidden_states``. The controller's ``_compute_serial_mtp_and_sample`` tests
``hasattr(unwrapped_model, '_decoder_hidden_states_cache')``, gathers the hidden states at the last accepted
positions, runs ``compute_mtp_single_step`` per depth and finally ``del``s the attribute. With block scope the
whole ``forward`` is one CUDA graph per batch dimension: the assignment ran during warmup/capture only (leaving
the last captured graph's internal tensor on the model); a replay re-runs the kernels, not the assignment. The
first step after capture is an eager prefill (non-decode), which sets and then deletes the attribute; the next step
is a decode replay, after which the attribute is missing, ``has_mtp`` is False, ``mtp_logits_2d`` stays ``None`` and
sampling it fails.
Doctor: host-work-frozen, at forward. The hand-off is an attribute assignment inside the captured region; it ran
once at capture, and replays repeat only the kernels, so what the controller finds after a replay is whatever the
capture (or the last eager step) left, not this step's hidden states.
Fix (upstream): ``DynamicInferenceContext`` allocates a persistent ``mtp_decoder_hidden_states`` buffer
``[max_tokens, 1, hidden]`` when ``num_speculative_tokens > 0`` and the scope is ``block``; ``forward`` writes
``mtp_decoder_hidden_states[:n].copy_(hidden_states)`` (a captured kernel, re-run by every replay, at one address for
every batch size) and assigns the tensor directly only for non-block scopes; the controller reads
``context.mtp_decoder_hidden_states`` and clears it only for non-block scopes.
Modelled: the parts named above. The model is an attention-free stand-in (token + position embedding, 2 pre-LN MLP
decoder layers, final LN, output layer) with one MTP layer (enorm, hnorm, ``eh_proj``, an MLP layer, final LN,
shared output layer); hidden states are ``[tokens, hidden]`` (upstream ``[tokens, 1, hidden]``), no KV cache (each
token's output depends on its id and position only), greedy sampling (argmax), one speculative token, and MTP
steps run eagerly (upstream may capture them in their own graphs). Block-scope graphs are captured per padded
token count, descending (8, 4 = 4 and 2 requests x 2 tokens), one eager warmup each, one shared pool; padded tokens
are zeroed each step. Decode steps are verified (draft accepted when the base logits' argmax equals it). Hidden 8,
vocab 16 (float64), ``max_tokens`` 16.
Workload: graphs for 8 and 4 tokens are captured. Requests A, B, C (prompts of 3, 4, 2 tokens) prefill eagerly (9
tokens, non-decode). Then two decode steps of 3 requests (6 tokens, the 8-token graph with 2 padded tokens), C
finishes, and one decode step of 2 requests (the 4-token graph). The bug raises at the first decode step; with the
fix every step's logits and MTP logits equal eager.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/Megatron-LM/pull/4950"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward"
SYMPTOM = ("MTP speculative decoding with whole-model (block-scope) CUDA graphs: the decoder hidden states are handed "
           "to the serial MTP step by a Python attribute assignment inside the captured forward, so after a replay the "
           "attribute is missing and _sample_from_logits_2d(None) raises AttributeError")

HIDDEN, VOCAB, MAX_POSITIONS = 8, 16, 32
MAX_TOKENS = 16
NUM_SPECULATIVE_TOKENS = 1
CUDA_GRAPH_TOKEN_COUNTS = [8, 4]         # decode graphs: requests * (1 + speculative tokens), descending

_variant = "bug"


@dataclasses.dataclass
class TransformerConfig:
    hidden_size: int = HIDDEN
    mtp_num_layers: int = 1
    inference_cuda_graph_scope: str = "none"          # "none" | "block"


class DynamicInferenceContext:
    def __init__(self, config: TransformerConfig, device):
        self.max_tokens, self.num_speculative_tokens = MAX_TOKENS, NUM_SPECULATIVE_TOKENS
        self.inference_cuda_graph_scope = config.inference_cuda_graph_scope
        self.mtp_decoder_hidden_states = None
        self._using_cuda_graph_this_step = False
        if (_variant == "fix" and self.num_speculative_tokens > 0
                and self.inference_cuda_graph_scope == "block"):       # PR #4950: persistent hand-off buffer
            self.mtp_decoder_hidden_states = torch.empty(self.max_tokens, config.hidden_size, device=device,
                                                         dtype=torch.float64)

    def is_dynamic_batching(self):
        return True

    def using_cuda_graph_this_step(self):
        return self._using_cuda_graph_this_step


def _mlp_layer(w, x):
    return x + F.gelu(F.layer_norm(x, (HIDDEN,), w["ln"]) @ w["fc1"]) @ w["fc2"]


class HybridModel:
    def __init__(self, config: TransformerConfig, device):
        self.config = config
        gen = generator(4950)
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        layer = lambda: {"ln": 1 + r(HIDDEN, scale=0.1), "fc1": r(HIDDEN, 2 * HIDDEN),  # noqa: E731
                         "fc2": r(2 * HIDDEN, HIDDEN)}
        self.embedding, self.position_embedding = r(VOCAB, HIDDEN, scale=1.0), r(MAX_POSITIONS, HIDDEN)
        self.decoder = [layer() for _ in range(2)]
        self.final_ln = 1 + r(HIDDEN, scale=0.1)
        self.output_layer = r(HIDDEN, VOCAB, scale=0.6)
        self.mtp = {"enorm": 1 + r(HIDDEN, scale=0.1), "hnorm": 1 + r(HIDDEN, scale=0.1),
                    "eh_proj": r(2 * HIDDEN, HIDDEN), "layer": layer(), "final_ln": 1 + r(HIDDEN, scale=0.1)}
        self.mtp_process = True

    def forward(self, input_ids, position_ids, inference_context=None):
        hidden_states = self.embedding[input_ids] + self.position_embedding[position_ids]
        for w in self.decoder:
            hidden_states = _mlp_layer(w, hidden_states)
        in_inference_mode = inference_context is not None
        is_spec_decode = (in_inference_mode and inference_context.is_dynamic_batching()
                          and inference_context.num_speculative_tokens > 0)
        if self.config.mtp_num_layers is not None and self.mtp_process and (in_inference_mode or is_spec_decode):
            if _variant == "fix":                                       # PR #4950
                if self.config.inference_cuda_graph_scope == "block":
                    inference_context.mtp_decoder_hidden_states[: hidden_states.shape[0]].copy_(hidden_states)
                else:
                    inference_context.mtp_decoder_hidden_states = hidden_states
            else:
                # Cache decoder hidden states for serial MTP computation after verification.
                self._decoder_hidden_states_cache = hidden_states
        return F.layer_norm(hidden_states, (HIDDEN,), self.final_ln) @ self.output_layer

    def compute_mtp_single_step(self, hidden_states, next_token_ids, position_ids, depth=None):
        m = self.mtp
        e = F.layer_norm(self.embedding[next_token_ids] + self.position_embedding[position_ids], (HIDDEN,), m["enorm"])
        h = F.layer_norm(hidden_states, (HIDDEN,), m["hnorm"])
        current_hidden = _mlp_layer(m["layer"], torch.cat([e, h], -1) @ m["eh_proj"])
        return current_hidden, F.layer_norm(current_hidden, (HIDDEN,), m["final_ln"]) @ self.output_layer


class CudaGraphManager:
    """Block scope: the whole model forward is one graph per padded token count (lookup table)."""

    def __init__(self, model, context, device):
        self.model, self.context, self.device = model, context, device
        self.inference_cudagraphs_lookup_table = {}
        self.pool = graph_pool_handle(device)

    def create_graph(self, token_count):
        ids = torch.zeros(token_count, dtype=torch.int64, device=self.device)
        pos = torch.zeros(token_count, dtype=torch.int64, device=self.device)
        state = ({"mtp_decoder_hidden_states": self.context.mtp_decoder_hidden_states}
                 if self.context.mtp_decoder_hidden_states is not None else None)
        g, out = capture(lambda: self.model.forward(ids, pos, self.context), device=self.device, pool=self.pool,
                         warmups=1, name=f"block graph [{token_count} tokens]", owner="CudaGraphManager (block)",
                         static={"input_ids": ids, "position_ids": pos}, state=state)
        self.inference_cudagraphs_lookup_table[token_count] = (g, out, ids, pos)

    def __call__(self, input_ids, position_ids):
        n = input_ids.shape[0]
        token_count = min(t for t in self.inference_cudagraphs_lookup_table if t >= n)
        g, out, ids, pos = self.inference_cudagraphs_lookup_table[token_count]
        ids[:n].copy_(input_ids)
        pos[:n].copy_(position_ids)
        ids[n:].zero_()                                                 # padded tokens: id 0, position 0
        pos[n:].zero_()
        return replay(g, out, real=n, size=token_count)[:n]


class TextGenerationController:
    def __init__(self, model, context, graphs):
        self.model, self.context, self.graphs = model, context, graphs
        self.num_mtp_depths = 1
        self._sampled_tokens_cuda = None
        self._last_accepted_seq_indices = None

    def _dynamic_step_forward_logits(self, input_ids, position_ids, is_decode_only):
        use_graph = (self.graphs is not None and is_decode_only
                     and input_ids.shape[0] <= max(CUDA_GRAPH_TOKEN_COUNTS))
        self.context._using_cuda_graph_this_step = use_graph
        if use_graph:
            return self.graphs(input_ids, position_ids)
        return self.model.forward(input_ids, position_ids, self.context)

    def _sample_from_logits_2d(self, logits_2d):
        return self._sample_kernel(logits_2d, logits_2d.shape[0])

    @staticmethod
    def _sample_kernel(logits, n):                                   # greedy stand-in for sample_kernel
        return torch.argmax(logits[:n], dim=-1)

    def _compute_serial_mtp_and_sample(self, base_position):
        context, unwrapped_model = self.context, self.model
        if _variant == "fix":
            has_mtp = context.mtp_decoder_hidden_states is not None
            hidden_states = context.mtp_decoder_hidden_states
        else:
            has_mtp = hasattr(unwrapped_model, "_decoder_hidden_states_cache")
            hidden_states = unwrapped_model._decoder_hidden_states_cache if has_mtp else None
        current_hidden = hidden_states[self._last_accepted_seq_indices] if has_mtp else None
        next_token_ids = self._sampled_tokens_cuda.clone()
        spec, mtp_logits_2d = [], None
        for depth in range(self.num_mtp_depths):
            mtp_logits_2d = None
            if has_mtp:
                current_hidden, mtp_logits_2d = unwrapped_model.compute_mtp_single_step(
                    current_hidden, next_token_ids, base_position + depth, depth)
            spec_tokens = self._sample_from_logits_2d(mtp_logits_2d)
            spec.append(spec_tokens)
            next_token_ids = spec_tokens
        if has_mtp:
            if _variant == "fix":
                if context.inference_cuda_graph_scope != "block":
                    context.mtp_decoder_hidden_states = None
            else:
                del unwrapped_model._decoder_hidden_states_cache
        return spec[0], mtp_logits_2d

    def step(self, requests, is_decode_only):
        """One engine step over ``requests`` (dicts with ``tokens`` and, for decode, ``draft``)."""
        ids, pos, last = [], [], []
        for r in requests:
            if is_decode_only:                                   # base token + draft token
                p = len(r["tokens"]) - 1
                ids += [r["tokens"][-1], r["draft"]]
                pos += [p, p + 1]
            else:
                ids += r["tokens"]
                pos += list(range(len(r["tokens"])))
            last.append(len(ids) - 1)
        dev = self.model.embedding.device
        logits = self._dynamic_step_forward_logits(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                                                   is_decode_only).clone()
        accepted_idx, new_tokens = [], []
        for i, r in enumerate(requests):                         # verify speculative tokens (greedy)
            if is_decode_only:
                base_pred = int(logits[last[i] - 1].argmax())
                if base_pred == r["draft"]:
                    r["tokens"] += [r["draft"], int(logits[last[i]].argmax())]
                    accepted_idx.append(last[i])
                else:
                    r["tokens"].append(base_pred)
                    accepted_idx.append(last[i] - 1)
            else:
                r["tokens"].append(int(logits[last[i]].argmax()))
                accepted_idx.append(last[i])
            new_tokens.append(r["tokens"][-1])
        self._last_accepted_seq_indices = torch.tensor(accepted_idx, device=dev)
        self._sampled_tokens_cuda = torch.tensor(new_tokens, device=dev)
        base_position = torch.tensor([len(r["tokens"]) - 1 for r in requests], device=dev)
        drafts, mtp_logits = self._compute_serial_mtp_and_sample(base_position)
        for r, d in zip(requests, drafts.tolist()):
            r["draft"] = d
        real_rows = torch.tensor(accepted_idx, device=dev)
        return [logits[real_rows], mtp_logits.clone()]


class DynamicInferenceEngine:
    def __init__(self, device, use_cuda_graphs):
        self.config = TransformerConfig(inference_cuda_graph_scope="block" if use_cuda_graphs else "none")
        self.model = HybridModel(self.config, device)
        self.context = DynamicInferenceContext(self.config, device)
        graphs = CudaGraphManager(self.model, self.context, device) if use_cuda_graphs else None
        self.controller = TextGenerationController(self.model, self.context, graphs)
        if use_cuda_graphs:
            self.create_cuda_graphs(graphs)

    def create_cuda_graphs(self, graphs):
        for token_count in CUDA_GRAPH_TOKEN_COUNTS:               # descending, as upstream
            graphs.create_graph(token_count)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(49500)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 4, 2)]

    def serve(use_cuda_graphs):
        engine = DynamicInferenceEngine(device, use_cuda_graphs)
        reqs = [{"tokens": list(p)} for p in prompts]
        outs = engine.controller.step(reqs, is_decode_only=False)          # prefill: eager
        outs += engine.controller.step(reqs, is_decode_only=True)           # 6 tokens -> graph 8
        outs += engine.controller.step(reqs, is_decode_only=True)
        outs += engine.controller.step(reqs[:2], is_decode_only=True)       # C finished: 4 tokens -> graph 4
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
