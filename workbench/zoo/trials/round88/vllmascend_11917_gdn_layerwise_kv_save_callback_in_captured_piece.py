"""Layerwise KV connector on a compiled prefill worker: the GDN layer's ``maybe_save_kv_layer_to_connector`` sits in the captured piece after the core op, so it runs at capture only.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/11917 ("[BugFix] Move KV layer saving to _forward_core for
compilation support", vllm-project/vllm-ascend, merged 2026-07-17, commit 12ddf3ce42). Read: the PR description and the
``vllm_ascend/ops/gdn.py`` diff (the call moves from ``AscendGatedDeltaNetAttention.forward`` Part 3 to the end of
``_forward_core``), ``AscendGatedDeltaNetAttention.forward`` at that commit, and ``save_kv_layer`` of
``mooncake_layerwise_connector.py`` (``current_layer``, ``layer_name == ""`` resolved through ``index_to_name``).
The added unit tests were not read; vLLM's ``maybe_save_kv_layer_to_connector`` is modelled from memory.
Symptom: P/D disaggregation of a hybrid GDN model (Qwen3.5) with ``MooncakeLayerwiseConnector``, prefill worker compiled
with PIECEWISE graphs: the prefill never emits ``done_sending_msg`` for the GDN/Mamba cache group, and the decode request
stays in ``WAITING_FOR_REMOTE_KVS`` for ever (eager prefill works).
Mechanism: ``forward()`` runs Part 1 (input projections), the opaque splitting op ``vllm::qwen_gdn_attention_core``
(-> ``_forward_core``: conv + SSM state update), then Part 3, which began with ``maybe_save_kv_layer_to_connector("",
[])`` before the gated norm and ``out_proj``. Part 3 belongs to the compiled piece after the splitting op; that piece is
traced once and captured as a piecewise graph. The Python callback is host work: it ran during the capture's dummy run
(no connector requests: a no-op) and a replay repeats only the piece's kernels, so at serving time the layer's save is
never called. The connector counts saves per step (``current_layer``); full-attention layers still save from inside
their own splitting op, so the count never reaches ``total_layers`` and the request is never reported done.
Doctor: host-work-frozen, at forward_part3 (Part 3 of upstream's ``AscendGatedDeltaNetAttention.forward``). The
connector callback is Python inside the captured piece; it ran at capture and replays never repeat it.
Fix (upstream): call ``maybe_save_kv_layer_to_connector("", [])`` at the end of ``_forward_core`` (inside the splitting
op, run eagerly on every step, after the states are updated).
Modelled: ``AscendGatedDeltaNetAttention`` (forward Part 1 / ``_forward_core`` / Part 3), a full-attention layer whose
``unified_attention_with_output`` saves its KV from inside the op, ``maybe_save_kv_layer_to_connector``,
``MooncakeLayerwiseConnectorWorker.save_kv_layer`` (current_layer, index_to_name, done_sending), a piecewise backend
(pieces captured per size with ``kit.capture`` in one pool, splitting ops run eagerly between replays) and a decode
worker that waits for ``done_sending`` and then decodes eagerly. Stand-ins: the GDN core is a gated delta-rule
recurrence on one head (dim 4) with the conv omitted; the Mooncake transfer is a copy into the decode worker's caches;
the decode scheduler's endless wait is a bounded poll that raises. Hidden 8, vocab 16, block size 4, capture sizes [4, 8].
Workload: the prefill worker prefills A (5 tokens, padded to 8) and then B (3 tokens, padded to 4); the decode worker
waits for both and decodes two steps. Bug: after the replays only the attention layer saved (current_layer 1 of 2),
so A is never done and the decode worker's wait raises. Fix: equals eager.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/11917"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "forward_part3"
SYMPTOM = ("PD disaggregation, Qwen3.5 + MooncakeLayerwiseConnector, PIECEWISE prefill: the GDN layer's "
           "maybe_save_kv_layer_to_connector lives in a captured piece, never runs on replay; the decode request "
           "waits in WAITING_FOR_REMOTE_KVS for ever")

HIDDEN, VOCAB, DK = 8, 16, 4
BLOCK_SIZE, MAX_BLOCKS_PER_REQ, NUM_BLOCKS, NUM_STATE_SLOTS = 4, 4, 9, 3     # block 0 / slot 0: reserved
MAX_NUM_TOKENS = 8
CUDAGRAPH_CAPTURE_SIZES = [4, 8]
GDN, ATTN = "model.layers.0.linear_attn", "model.layers.1.self_attn.attn"

_variant = "bug"
_forward_context = None
_kv_transfer_group = None


class KVTransferTimeout(RuntimeError):
    pass


class ForwardContext:
    def __init__(self, attn_metadata, connector_metadata):
        self.attn_metadata = attn_metadata
        self.connector_metadata = connector_metadata


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: list):
    connector = _kv_transfer_group
    if connector is None or _forward_context is None or _forward_context.attn_metadata is None:
        return
    connector.save_kv_layer(layer_name, kv_cache_layer, _forward_context.attn_metadata,
                            _forward_context.connector_metadata)


class MooncakeLayerwiseConnectorWorker:
    def __init__(self, is_kv_producer, remote=None):
        self.is_kv_producer, self.remote = is_kv_producer, remote
        self.index_to_name = [GDN, ATTN]
        self.total_layers = len(self.index_to_name)
        self.current_layer = 0
        self.kv_caches = {}
        self.done_sending: set[str] = set()

    def register_kv_caches(self, kv_caches):
        self.kv_caches = kv_caches

    def start_load_kv(self):                   # per step: the layer count starts over
        self.current_layer = 0

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, connector_metadata):
        if not (self.is_kv_producer and connector_metadata.keys()):
            return
        if self.current_layer >= self.total_layers:
            self.current_layer += 1
            return
        if layer_name == "":
            layer_name = self.index_to_name[self.current_layer]
        for req_id, (state_index, block_ids) in connector_metadata.items():     # the Mooncake transfer
            if layer_name == GDN:
                self.remote.kv_caches[GDN][0][state_index] = self.kv_caches[GDN][0][state_index]
            else:
                for cache, remote in zip(self.kv_caches[ATTN], self.remote.kv_caches[ATTN]):
                    remote[block_ids] = cache[block_ids]
        self.current_layer += 1
        if self.current_layer == self.total_layers:
            self.remote.done_sending.update(connector_metadata.keys())           # done_sending_msg


class AttnMetadata:
    def __init__(self, num_actual_tokens, query_start_loc, seq_lens, state_indices, slot_mapping, block_table):
        self.num_actual_tokens, self.query_start_loc, self.seq_lens = num_actual_tokens, query_start_loc, seq_lens
        self.state_indices, self.slot_mapping, self.block_table = state_indices, slot_mapping, block_table


class AscendGatedDeltaNetAttention:
    def __init__(self, r, device):
        self.in_proj_qkv, self.in_proj_ba, self.in_proj_z = r(HIDDEN, 3 * DK), r(HIDDEN, 2), r(HIDDEN, DK)
        self.norm_weight, self.out_proj = 1.0 + r(DK, scale=0.1), r(DK, HIDDEN)
        self.ssm_state = torch.zeros(NUM_STATE_SLOTS, DK, DK, device=device, dtype=torch.float64)

    def forward_part1(self, hidden_states):
        mixed_qkv, ba, z = hidden_states @ self.in_proj_qkv, hidden_states @ self.in_proj_ba, hidden_states @ self.in_proj_z
        core_attn_out = torch.zeros(hidden_states.shape[0], DK, dtype=hidden_states.dtype, device=hidden_states.device)
        return mixed_qkv, ba, z, core_attn_out

    def _forward_core(self, mixed_qkv, ba, core_attn_out):
        """The ``vllm::qwen_gdn_attention_core`` splitting op (eager on every step)."""
        meta = _forward_context.attn_metadata[GDN]
        q, k, v = F.normalize(mixed_qkv[:, :DK], dim=-1), F.normalize(mixed_qkv[:, DK:2 * DK], dim=-1), mixed_qkv[:, 2 * DK:]
        beta, g = torch.sigmoid(ba[:, 0]), torch.exp(-F.softplus(ba[:, 1]))
        qsl = meta.query_start_loc
        for i, slot in enumerate(meta.state_indices):
            state = self.ssm_state[slot] if meta.seq_lens[i] > qsl[i + 1] - qsl[i] else torch.zeros_like(self.ssm_state[0])
            for t in range(qsl[i], qsl[i + 1]):
                state = g[t] * state
                state = state + beta[t] * torch.outer(k[t], v[t] - k[t] @ state)
                core_attn_out[t] = q[t] @ state
            self.ssm_state[slot] = state
        if _variant == "fix":                      # upstream fix: save from inside the splitting op
            maybe_save_kv_layer_to_connector("", [])

    def forward_part3(self, core_attn_out, z):
        if _variant == "bug":                      # Python in the captured piece: runs at capture only
            maybe_save_kv_layer_to_connector("", [])
        normed = core_attn_out * torch.rsqrt(core_attn_out.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return (normed * F.silu(z)) @ self.out_proj


class Attention:
    def __init__(self, r, device):
        self.qkv_proj, self.o_proj = r(HIDDEN, 3 * DK), r(DK, HIDDEN)
        self.key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, DK, device=device, dtype=torch.float64)
        self.value_cache = torch.zeros_like(self.key_cache)

    def unified_attention_with_output(self, qkv, output):
        """The attention splitting op: cache write, causal attention, and the layer's own KV save."""
        meta = _forward_context.attn_metadata[ATTN]
        n = meta.num_actual_tokens
        q, k, v = qkv[:n, :DK], qkv[:n, DK:2 * DK], qkv[:n, 2 * DK:]
        self.key_cache.view(-1, DK)[meta.slot_mapping] = k
        self.value_cache.view(-1, DK)[meta.slot_mapping] = v
        qsl = meta.query_start_loc
        for i in range(len(meta.seq_lens)):
            j = torch.arange(int(meta.seq_lens[i]), device=qkv.device)
            slots = meta.block_table[i, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
            keys, vals = self.key_cache.view(-1, DK)[slots], self.value_cache.view(-1, DK)[slots]
            pos = torch.arange(int(meta.seq_lens[i]) - (qsl[i + 1] - qsl[i]), int(meta.seq_lens[i]), device=qkv.device)
            scores = (q[qsl[i]:qsl[i + 1]] @ keys.T) * DK ** -0.5
            scores = scores.masked_fill(j.view(1, -1) > pos.view(-1, 1), -1e9)
            output[qsl[i]:qsl[i + 1]] = torch.softmax(scores, -1) @ vals
        maybe_save_kv_layer_to_connector(ATTN, [self.key_cache, self.value_cache])


class HybridModel:
    """Layer 0 GDN, layer 1 full attention; split at the two splitting ops into three pieces."""

    def __init__(self, device):
        gen = generator(11917)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed, self.lm_head = r(VOCAB, HIDDEN, scale=1.0), r(HIDDEN, VOCAB, scale=0.8)
        self.linear_attn, self.self_attn = AscendGatedDeltaNetAttention(r, device), Attention(r, device)
        self.kv_caches = {GDN: [self.linear_attn.ssm_state], ATTN: [self.self_attn.key_cache, self.self_attn.value_cache]}

    def submod_0(self, input_ids):
        x = self.embed[input_ids]
        return (x, *self.linear_attn.forward_part1(x))

    def submod_1(self, x, core_attn_out, z):
        h = x + self.linear_attn.forward_part3(core_attn_out, z)
        return h, h @ self.self_attn.qkv_proj, torch.zeros(h.shape[0], DK, dtype=h.dtype, device=h.device)

    def submod_2(self, h, attn_out):
        return (h + attn_out @ self.self_attn.o_proj) @ self.lm_head

    def forward(self, input_ids):
        x, mixed_qkv, ba, z, core = self.submod_0(input_ids)
        self.linear_attn._forward_core(mixed_qkv, ba, core)
        h, qkv, attn_out = self.submod_1(x, core, z)
        self.self_attn.unified_attention_with_output(qkv, attn_out)
        return self.submod_2(h, attn_out)


class PiecewiseBackend:
    """Each piece captured per size; the splitting ops run eagerly between the replays."""

    def __init__(self, runner, device):
        self.runner, self.graphs, pool = runner, {}, graph_pool_handle(device)
        m, ids = runner.model, runner.input_ids
        for n in CUDAGRAPH_CAPTURE_SIZES:
            runner.set_forward_context(runner.dummy_metadata(n), {})
            kw = dict(device=device, pool=pool, owner="PiecewiseBackend")
            g0, o0 = capture(lambda n=n: m.submod_0(ids[:n]), name=f"piece 0 [{n}]", static={"input_ids": ids}, **kw)
            m.linear_attn._forward_core(o0[1], o0[2], o0[4])
            g1, o1 = capture(lambda o0=o0: m.submod_1(o0[0], o0[4], o0[3]), name=f"piece 1 [{n}]", **kw)
            m.self_attn.unified_attention_with_output(o1[1], o1[2])
            g2, o2 = capture(lambda o1=o1: m.submod_2(o1[0], o1[2]), name=f"piece 2 [{n}]", **kw)
            self.graphs[n] = (g0, o0, g1, o1, g2, o2)

    def __call__(self, num_tokens):
        n = next(s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens)
        g0, o0, g1, o1, g2, o2 = self.graphs[n]
        m, pad = self.runner.model, {"input_ids": self.runner.input_ids}
        replay(g0, o0, real=num_tokens, size=n, padded=pad)
        m.linear_attn._forward_core(o0[1], o0[2], o0[4])
        replay(g1, o1, real=num_tokens, size=n)
        m.self_attn.unified_attention_with_output(o1[1], o1[2])
        return replay(g2, o2, real=num_tokens, size=n)[:num_tokens]


class Worker:
    def __init__(self, device, connector, use_piecewise_graph):
        self.device, self.connector = device, connector
        self.model = HybridModel(device)
        self.kv_caches = self.model.kv_caches
        connector.register_kv_caches(self.kv_caches)
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=device)
        self.backend = PiecewiseBackend(self, device) if use_piecewise_graph else None

    def set_forward_context(self, meta, connector_metadata):
        global _forward_context, _kv_transfer_group
        _forward_context = ForwardContext({GDN: meta, ATTN: meta}, connector_metadata)
        _kv_transfer_group = self.connector

    def dummy_metadata(self, n):
        zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
        return AttnMetadata(n, [0, n], torch.tensor([n]), [0], zeros, zeros.view(1, -1)[:, :MAX_BLOCKS_PER_REQ])

    def execute_model(self, reqs):
        """``reqs``: (req_id, token_ids, num_computed, state_index, block_ids) scheduled this step."""
        tokens = torch.cat([t for _, t, *_ in reqs])
        n = tokens.numel()
        qsl = [0]
        for _, t, *_ in reqs:
            qsl.append(qsl[-1] + t.numel())
        seq_lens = torch.tensor([c + t.numel() for _, t, c, *_ in reqs])
        block_table = torch.stack([b for *_, b in reqs]).to(self.device)
        pos = torch.cat([torch.arange(c, c + t.numel()) for _, t, c, *_ in reqs])
        req_of = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor([t.numel() for _, t, *_ in reqs]))
        slot_mapping = (block_table[req_of.to(self.device), (pos // BLOCK_SIZE).to(self.device)] * BLOCK_SIZE
                        + (pos % BLOCK_SIZE).to(self.device))
        meta = AttnMetadata(n, qsl, seq_lens, [s for *_, s, _ in reqs], slot_mapping, block_table)
        connector_metadata = {rid: (s, b.to(self.device)) for rid, t, c, s, b in reqs if c == 0}
        self.set_forward_context(meta, connector_metadata if self.connector.is_kv_producer else {})
        self.connector.start_load_kv()
        self.input_ids[:n] = tokens.to(self.device)
        if self.backend is None:
            return self.model.forward(self.input_ids[:n]).clone()
        return self.backend(n).clone()


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(use_piecewise_graph: bool):
        decode = Worker(device, MooncakeLayerwiseConnectorWorker(is_kv_producer=False), False)
        prefill = Worker(device, MooncakeLayerwiseConnectorWorker(True, remote=decode.connector),
                         use_piecewise_graph)
        gen = generator(11918)
        prompts = {"A": torch.randint(0, VOCAB, (5,), generator=gen), "B": torch.randint(0, VOCAB, (3,), generator=gen)}
        state_index = {"A": 1, "B": 2}
        blocks = {"A": torch.tensor([1, 2, 3, 4]), "B": torch.tensor([5, 6, 7, 8])}
        outs, next_tok, ctx = [], {}, {}
        for rid, ids in prompts.items():                    # prefill worker: one request per step
            logits = prefill.execute_model([(rid, ids, 0, state_index[rid], blocks[rid])])
            outs.append(logits[-1])
            next_tok[rid], ctx[rid] = logits[-1].argmax().view(1).cpu(), ids.numel()
        for _ in range(3):                                  # decode scheduler: WAITING_FOR_REMOTE_KVS
            if set(prompts) <= decode.connector.done_sending:
                break
        else:
            waiting = sorted(set(prompts) - decode.connector.done_sending)
            raise KVTransferTimeout(f"requests {waiting} stay in WAITING_FOR_REMOTE_KVS: the prefill worker never sent "
                                    f"done_sending_msg (its connector counted {prefill.connector.current_layer} of "
                                    f"{prefill.connector.total_layers} layer saves)")
        for _ in range(2):                                  # decode worker: eager decode steps
            logits = decode.execute_model([(r, next_tok[r], ctx[r], state_index[r], blocks[r]) for r in prompts])
            outs.append(logits)
            for i, r in enumerate(prompts):
                next_tok[r], ctx[r] = logits[i].argmax().view(1).cpu(), ctx[r] + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
