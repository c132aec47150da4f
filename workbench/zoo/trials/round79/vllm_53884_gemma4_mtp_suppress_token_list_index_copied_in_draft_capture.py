"""The Gemma4 MTP drafter masks its suppress tokens with ``logits[:, <Python list>] = -inf`` inside the captured draft graph: a host-to-device copy that capture refuses, so the engine never starts.

Upstream: https://github.com/vllm-project/vllm/pull/53884 ("[Bugfix] Make Gemma4 MTP suppress_tokens masking
CUDA-graph-safe", opened 2026-08-26 and merged; issue #48503, "Gemma 4 MTP speculative decoding crashes during
CUDA graph capture (`_suppress_token_ids` is a Python list, not a device tensor)"; earlier unmerged attempts #48509
and #48515).
Symptom: engine start fails every time, during the speculator's graph capture ("Capturing prefill CUDA graphs"),
with ``RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is
pinned``. The trigger is any MTP draft whose ``generation_config`` has non-empty ``suppress_tokens`` (for example
``google/gemma-4-12B-it-assistant``, ``[258883, 258882]``). With ``enforce_eager``, or with a draft that has no
suppress tokens, serving works.
Mechanism: ``Gemma4MTP.__init__`` (``vllm/model_executor/models/gemma4_mtp.py``) keeps the draft's
``generation_config["suppress_tokens"]`` as a Python list, ``self._suppress_token_ids``. ``Gemma4MTP.compute_logits``
then masked them with ``logits[:, self._suppress_token_ids] = -float("inf")``. Advanced indexing with a Python list
builds the index tensor in pageable host memory and copies it to the device on every call. The ``-inf`` of the
indexed assignment is made into a host scalar tensor and copied too (``index_put_``). Eagerly both copies are
legal. The V2 model runner (now the default for non-MoE models) captures the drafter's whole prefill routine as one
FULL graph: ``AutoRegressiveSpeculator.capture`` -> ``SpeculatorCudaGraphManager.capture(self._prefill)``, and
``_prefill`` -> ``sample_draft`` -> ``_greedy_sample_draft`` -> ``self.model.compute_logits``. During stream
capture CUDA refuses a copy from pageable memory, so the capture aborts and the engine does not start.
Doctor: sync-in-capture, at compute_logits. A host-to-device copy of Python data (pageable memory) is attempted
while a capture is open, which a capturing stream refuses. The copy comes from the masking line in
``Gemma4MTP.compute_logits``, and that line is what the fix replaced. (The fix also added the tensor's
construction to ``load_weights`` and its attribute to ``__init__``.)
Fix (upstream): ``load_weights`` builds ``self._suppress_idx = torch.tensor(self._suppress_token_ids,
dtype=torch.long, device=next(self.parameters()).device)`` once, after the weights are loaded and before any
capture. ``compute_logits`` masks with ``logits.index_fill_(1, self._suppress_idx, -float("inf"))``: the index is
already on the device and ``index_fill_`` takes the value as a scalar argument, so nothing crosses from the host.
The PR rejects a lazy "build it on first call" tensor, because the drafter's first call already happens under
capture, where even a pinned copy would record a host read into the graph. (Read: the fixed ``gemma4_mtp.py`` at
a stored commit, the PR and issue descriptions, #48509 and #48515, which quote the replaced line, and the V2
``autoregressive/speculator.py``, ``spec_decode/speculator.py`` and ``gemma4/speculator.py``.)
Modelled: a drafter with a vocabulary of 16 and a hidden size of 8 (the backbone hidden size is 8 too); suppress
tokens ``[15, 14]``, whose ``lm_head`` rows are scaled up so that they would often win the argmax without the mask.
``Gemma4MultiTokenPredictor`` has the shared-embedding scale, ``pre_projection``, one decoder layer reduced to its
RMSNorm + gated MLP (the Q-only attention over the target's KV cache is left out, and so are positions, RoPE,
``seq_lens`` and attention metadata), the final norm and ``post_projection``. ``LogitsProcessor`` is a matmul
plus Gemma's final-logit soft cap (30). Sampling is greedy (``draft_logits`` is None). The speculator has 4 requests
and 3 speculative tokens. Uniform decode batches have 4 tokens per request, some of them rejected. One FULL graph
of ``_prefill`` and one FULL graph of ``_generate_draft`` are captured (the unfused multi-step decode, one replay
per draft step), each for 4 requests. ``prepare_prefill_inputs``, ``prepare_decode_inputs`` and
``update_draft_inputs`` are torch versions of the Triton kernels, with Gemma4's constant positions. The target
model's outputs (token ids, last hidden states, rejections, last sampled tokens) are drawn at random per step.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/53884"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "compute_logits"
SYMPTOM = ("engine start fails capturing the Gemma4 MTP draft graph: compute_logits indexes the logits with the "
           "Python list of suppress_tokens, a pageable host-to-device copy that stream capture refuses")

VOCAB, HIDDEN, BACKBONE_HIDDEN, INTERMEDIATE = 16, 8, 8, 16
SUPPRESS_TOKENS = [15, 14]                     # google/gemma-4-12B-it-assistant: [258883, 258882]
FINAL_LOGIT_SOFTCAPPING = 30.0
RMS_NORM_EPS = 1e-6
MAX_NUM_REQS, NUM_SPECULATIVE_TOKENS = 4, 3
MAX_NUM_TOKENS = MAX_NUM_REQS * (NUM_SPECULATIVE_TOKENS + 1)
STEPS = 6


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS) * weight


# --- vllm/config: the draft model config ---------------------------------------------------------------------

class DraftModelConfig:
    def __init__(self, generation_config: dict | None):
        self._generation_config = generation_config

    def try_get_generation_config(self) -> dict | None:
        return self._generation_config


# --- vllm/model_executor/models/gemma4_mtp.py ----------------------------------------------------------------

class Gemma4MultiTokenPredictor:
    def __init__(self, device):
        self.embed_tokens = torch.empty(VOCAB, BACKBONE_HIDDEN, device=device)   # replaced by the target's
        self.normalizer = torch.tensor(BACKBONE_HIDDEN ** 0.5, device=device)
        self.pre_projection = torch.empty(2 * BACKBONE_HIDDEN, HIDDEN, device=device)
        self.pre_feedforward_layernorm = torch.empty(HIDDEN, device=device)
        self.gate_up_proj = torch.empty(HIDDEN, 2 * INTERMEDIATE, device=device)
        self.down_proj = torch.empty(INTERMEDIATE, HIDDEN, device=device)
        self.norm = torch.empty(HIDDEN, device=device)
        self.post_projection = torch.empty(HIDDEN, BACKBONE_HIDDEN, device=device)

    def named_parameters(self):
        for name in ("pre_projection", "pre_feedforward_layernorm", "gate_up_proj", "down_proj", "norm",
                     "post_projection"):
            yield f"model.{name}", getattr(self, name)

    def embed_input_ids(self, input_ids):
        return self.embed_tokens[input_ids] * self.normalizer

    def forward(self, input_ids, hidden_states):
        """Returns (draft_hidden_states, backbone_hidden_states)."""
        inputs_embeds = self.embed_input_ids(input_ids)
        combined = torch.cat([inputs_embeds, hidden_states], dim=-1)
        hidden_states = combined @ self.pre_projection
        residual = hidden_states                                   # decoder layer: its MLP half
        gate, up = (rms_norm(hidden_states, self.pre_feedforward_layernorm) @ self.gate_up_proj).chunk(2, -1)
        hidden_states = residual + (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ self.down_proj
        draft_hidden_states = rms_norm(hidden_states, self.norm)
        backbone_hidden_states = draft_hidden_states @ self.post_projection
        return draft_hidden_states, backbone_hidden_states


class Gemma4MTP:
    """Gemma4 Multi-Token Prediction model for speculative decoding."""

    def __init__(self, draft_model_config: DraftModelConfig, device, variant: str):
        self.variant = variant
        self.model = Gemma4MultiTokenPredictor(device)
        self.lm_head = torch.empty(VOCAB, HIDDEN, device=device)
        gen_cfg = draft_model_config.try_get_generation_config()
        self._suppress_token_ids = gen_cfg.get("suppress_tokens") if gen_cfg else None
        # (fix) Materialized on-device in load_weights: compute_logits runs under CUDA graph capture in the V2
        # speculator, where indexing with a Python list would issue an unpinned H2D copy (illegal during capture).
        self._suppress_idx: torch.Tensor | None = None

    def parameters(self):
        for _, p in self.model.named_parameters():
            yield p
        yield self.lm_head

    def embed_input_ids(self, input_ids):
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, hidden_states):
        return self.model.forward(input_ids, hidden_states)

    def logits_processor(self, lm_head, hidden_states):
        logits = hidden_states @ lm_head.T
        return torch.tanh(logits / FINAL_LOGIT_SOFTCAPPING) * FINAL_LOGIT_SOFTCAPPING

    def compute_logits(self, hidden_states):
        logits = self.logits_processor(self.lm_head, hidden_states)
        if self.variant == "bug":
            # before #53884: a Python list as the index (and a Python -inf through index_put_): two pageable
            # host-to-device copies, on every call, inside the captured draft prefill/decode graphs
            if logits is not None and self._suppress_token_ids:
                logits[:, self._suppress_token_ids] = -float("inf")
        elif logits is not None and self._suppress_idx is not None:
            logits.index_fill_(1, self._suppress_idx, -float("inf"))
        return logits

    def load_weights(self, weights):
        params = dict(self.model.named_parameters())
        params["lm_head.weight"] = self.lm_head
        loaded = set()
        for name, w in weights:
            params[name].copy_(w)
            loaded.add(name)
        if self.variant == "fix" and self._suppress_token_ids:
            self._suppress_idx = torch.tensor(self._suppress_token_ids, dtype=torch.long,
                                              device=next(self.parameters()).device)
        return loaded


def draft_checkpoint():
    """The assistant's checkpoint: the same numbers for every load."""
    gen = generator(53884)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen) * HIDDEN ** -0.5
    lm_head[SUPPRESS_TOKENS] *= 4.0                 # tokens the assistant must never propose, yet likes
    return [
        ("model.pre_projection",
         torch.randn(2 * BACKBONE_HIDDEN, HIDDEN, generator=gen) * (2 * BACKBONE_HIDDEN) ** -0.5),
        ("model.pre_feedforward_layernorm", 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen)),
        ("model.gate_up_proj", torch.randn(HIDDEN, 2 * INTERMEDIATE, generator=gen) * HIDDEN ** -0.5),
        ("model.down_proj", torch.randn(INTERMEDIATE, HIDDEN, generator=gen) * INTERMEDIATE ** -0.5),
        ("model.norm", 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen)),
        ("model.post_projection", torch.randn(HIDDEN, BACKBONE_HIDDEN, generator=gen) * HIDDEN ** -0.5),
        ("lm_head.weight", lm_head),
    ]


# --- the target model (Gemma4ForCausalLM): only what the speculator takes from it ------------------------------

class TargetModel:
    def __init__(self, device):
        self.embed_tokens = randn(VOCAB, BACKBONE_HIDDEN, gen=generator(4850), device=device, scale=0.3)


# --- vllm/v1/worker/gpu/input_batch.py ----------------------------------------------------------------------

class InputBuffers:
    def __init__(self, max_num_reqs, max_num_tokens, device):
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)


class InputBatch:
    def __init__(self, input_ids, query_start_loc):
        self.input_ids = input_ids                      # [num_tokens]: the target's scheduled tokens
        self.query_start_loc = query_start_loc          # [num_reqs + 1]
        self.num_reqs = query_start_loc.shape[0] - 1
        self.num_tokens = input_ids.shape[0]


# --- vllm/v1/worker/gpu/spec_decode/autoregressive/cudagraph_utils.py ----------------------------------------

class SpeculatorCudaGraphManager:
    """FULL graphs of one speculator routine, one per number of requests."""

    def __init__(self, device, name, decode_query_len):
        self.device, self.name, self.decode_query_len = device, name, decode_query_len
        self.graphs: dict[int, tuple] = {}

    def capture(self, fn, sizes, *, static, outputs):
        for num_reqs in sorted(sizes, reverse=True):
            num_tokens = num_reqs * self.decode_query_len
            g, _ = capture(lambda n=num_reqs, t=num_tokens: fn(n, t), device=self.device, warmups=1,
                           name=f"{self.name} num_reqs={num_reqs}", static=static,
                           owner="AutoRegressiveSpeculator")
            self.graphs[num_reqs] = (g, outputs(num_reqs))

    def run_fullgraph(self, num_reqs):
        g, out = self.graphs[num_reqs]
        replay(g, out)


# --- vllm/v1/worker/gpu/spec_decode/autoregressive/speculator.py (Triton kernels as torch) --------------------

def prepare_prefill_inputs(last_token_indices, current_draft_step, input_buffers, input_batch, num_rejected,
                           last_sampled):
    """Shift the target's ids by one, put the last sampled token after each request's accepted ones."""
    n = input_batch.num_tokens
    qsl = input_batch.query_start_loc
    query_len = qsl[1:] - qsl[:-1] - num_rejected
    input_buffers.input_ids[:n - 1] = input_batch.input_ids[1:]
    last_token_indices[:input_batch.num_reqs] = qsl[:-1] + query_len - 1
    input_buffers.input_ids[last_token_indices[:input_batch.num_reqs]] = last_sampled
    current_draft_step.zero_()
    return last_token_indices


def prepare_decode_inputs(draft_tokens, input_buffers):
    """Draft token -> input id (Gemma4: positions and seq_lens stay as they are)."""
    input_buffers.input_ids[:draft_tokens.shape[0]] = draft_tokens


def update_draft_inputs(draft_tokens, current_draft_step, hidden_states, output_draft_tokens,
                        next_input_hidden_states, input_buffers, num_reqs, num_speculative_steps):
    step = current_draft_step.view(1, 1).expand(num_reqs, 1)
    output_draft_tokens[:num_reqs].scatter_(1, step, draft_tokens[:, None])
    final = current_draft_step >= num_speculative_steps - 1        # the final step skips the input updates
    ids = input_buffers.input_ids[:num_reqs]
    ids.copy_(torch.where(final, ids, draft_tokens))
    nxt = next_input_hidden_states[:num_reqs]
    nxt.copy_(torch.where(final, nxt, hidden_states[:num_reqs]))


class Gemma4Speculator:
    """``AutoRegressiveSpeculator`` with Gemma4's ``advance_draft_positions = False``, greedy drafts."""

    def __init__(self, device, variant, enforce_eager):
        self.device, self.variant, self.enforce_eager = device, variant, enforce_eager
        self.max_num_reqs, self.max_num_tokens = MAX_NUM_REQS, MAX_NUM_TOKENS
        self.num_speculative_steps = NUM_SPECULATIVE_TOKENS
        self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, device)
        self.hidden_states = torch.zeros(self.max_num_tokens, BACKBONE_HIDDEN, device=device)
        self.current_draft_step = torch.tensor(0, dtype=torch.int64, device=device)
        self.last_token_indices = torch.zeros(self.max_num_reqs, dtype=torch.int64, device=device)
        self.idx_mapping = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self.draft_tokens = torch.zeros(self.max_num_reqs, self.num_speculative_steps, dtype=torch.int64,
                                        device=device)
        self.prefill_cudagraph_manager = SpeculatorCudaGraphManager(device, "draft prefill",
                                                                    self.num_speculative_steps + 1)
        self.decode_cudagraph_manager = SpeculatorCudaGraphManager(device, "draft decode", 1)

    def load_model(self, target_model):
        draft_model_config = DraftModelConfig({"suppress_tokens": list(SUPPRESS_TOKENS)})
        self.model = Gemma4MTP(draft_model_config, self.device, self.variant)
        self.model.load_weights(draft_checkpoint())
        self.model.model.embed_tokens = target_model.embed_tokens        # _share_embeddings

    def capture(self):
        self.last_token_indices.zero_()
        self.idx_mapping.zero_()
        # The prefill routine (model forward + compute_logits + sample) is recorded as one FULL graph.
        self.prefill_cudagraph_manager.capture(
            self._prefill, [self.max_num_reqs],
            static={"input_ids": self.input_buffers.input_ids, "hidden_states": self.hidden_states,
                    "last_token_indices": self.last_token_indices},
            outputs=lambda n: self.draft_tokens[:n])
        self.decode_cudagraph_manager.capture(
            self._generate_draft, [self.max_num_reqs],
            static={"input_ids": self.input_buffers.input_ids, "hidden_states": self.hidden_states,
                    "current_draft_step": self.current_draft_step},
            outputs=lambda n: self.draft_tokens[:n])

    def propose(self, input_batch, last_hidden_states, num_rejected, last_sampled):
        num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        self.hidden_states[:num_tokens].copy_(last_hidden_states)
        prepare_prefill_inputs(self.last_token_indices, self.current_draft_step, self.input_buffers,
                               input_batch, num_rejected, last_sampled)
        if not self.enforce_eager and num_reqs in self.prefill_cudagraph_manager.graphs:
            self.prefill_cudagraph_manager.run_fullgraph(num_reqs)
        else:
            self._prefill(num_reqs, num_tokens)
        if self.num_speculative_steps == 1:
            return self.draft_tokens[:num_reqs, :1]
        prepare_decode_inputs(self.draft_tokens[:num_reqs, 0], self.input_buffers)
        for step in range(1, self.num_speculative_steps):                 # _multi_step_decode
            self.current_draft_step.fill_(step)
            if not self.enforce_eager and num_reqs in self.decode_cudagraph_manager.graphs:
                self.decode_cudagraph_manager.run_fullgraph(num_reqs)
            else:
                self._generate_draft(num_reqs, num_reqs)
        return self.draft_tokens[:num_reqs]

    def _run_model(self, num_tokens):
        return self.model.forward(self.input_buffers.input_ids[:num_tokens], self.hidden_states[:num_tokens])

    def _greedy_sample_draft(self, hidden_states):
        logits = self.model.compute_logits(hidden_states)
        return logits.argmax(dim=-1)

    def sample_draft(self, hidden_states):
        return self._greedy_sample_draft(hidden_states)

    def _prefill(self, num_reqs, num_tokens):
        last_token_indices = self.last_token_indices[:num_reqs]
        last_hidden_states, hidden_states = self._run_model(num_tokens)
        sample_hidden_states = last_hidden_states[last_token_indices]
        self.draft_tokens[:num_reqs, 0] = self.sample_draft(sample_hidden_states)
        self.hidden_states[:num_reqs] = hidden_states[last_token_indices]

    def _generate_draft(self, num_reqs, num_tokens_padded):
        last_hidden_states, hidden_states = self._run_model(num_tokens_padded)
        draft_tokens = self.sample_draft(last_hidden_states[:num_reqs])
        update_draft_inputs(draft_tokens, self.current_draft_step, hidden_states, self.draft_tokens,
                            self.hidden_states, self.input_buffers, num_reqs, self.num_speculative_steps)


def target_steps(device):
    """Per step: the target's scheduled ids, its last hidden states, rejections and last sampled tokens."""
    gen = generator(48503)
    per_req = NUM_SPECULATIVE_TOKENS + 1
    qsl = torch.arange(MAX_NUM_REQS + 1, dtype=torch.long) * per_req
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (MAX_NUM_TOKENS,), generator=gen)
        hidden = torch.randn(MAX_NUM_TOKENS, BACKBONE_HIDDEN, generator=gen)
        num_rejected = torch.randint(0, per_req, (MAX_NUM_REQS,), generator=gen)
        last_sampled = torch.randint(0, VOCAB, (MAX_NUM_REQS,), generator=gen)
        steps.append((InputBatch(ids.to(device), qsl.to(device)), hidden.to(device), num_rejected.to(device),
                      last_sampled.to(device)))
    return steps


def run(variant: str, device: str = "cpu"):
    steps = target_steps(device)

    def serve(enforce_eager):
        target = TargetModel(device)
        speculator = Gemma4Speculator(device, variant, enforce_eager)
        speculator.load_model(target)
        if not enforce_eager:
            speculator.capture()                      # engine start: "Capturing prefill CUDA graphs"
        return [speculator.propose(*step).clone() for step in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
