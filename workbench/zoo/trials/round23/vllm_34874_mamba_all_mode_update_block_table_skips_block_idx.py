"""A second Mamba group's FULL decode graph reads block indices its builder never refreshes.

Upstream: https://github.com/vllm-project/vllm/pull/34874 ("[Bugfix] Fix prefix caching for Mamba 'all' mode
(Nemotron models)"), fixing https://github.com/vllm-project/vllm/issues/34865.
Symptom: Nemotron hybrid models served with prefix caching (``mamba_cache_mode="all"``) produced NaN logprobs
and garbage tokens once CUDA graphs were on (vLLM V1, February 2026); ``"align"``/``"none"`` modes and eager
mode were fine.
Mechanism: Nemotron has many KV-cache groups with an identical ``MambaSpec``. ``_build_attn_group_metadata``
caches metadata by ``(kv_cache_spec, type(builder))``: the first Mamba group calls ``build()``, every later
group calls ``update_block_table()`` on a shallow copy. ``build()`` (through
``_update_metadata_for_cudagraph_capture``) copies ``state_indices_tensor``, ``block_idx_last_scheduled_token``
and ``block_idx_last_computed_token`` into the *first* builder's persistent CUDA-graph buffers;
``update_block_table()`` copies the new ``state_indices_tensor`` into its *own* builder's persistent buffer but
leaves the two block-index tensors pointing at the first builder's buffers. Eagerly that is harmless (same
batch, same values). A FULL decode graph, however, was captured with each group's metadata built by its own
builder (``build_for_cudagraph_capture``), so the later groups' layers read the block indices from their own
builders' buffers, which no step writes after capture: the decode reads the SSM state of, and writes the
new state into, the block the capture's dummy batch named (column 0), not the request's current block.
Doctor: stale-input, at ``update_block_table`` (the refresh of the second builder's ``block_idx_*`` buffers the
replayed graph reads is skipped).
Fix (upstream): ``BaseMambaAttentionMetadataBuilder.update_block_table()`` also copies
``block_idx_last_scheduled_token`` and ``block_idx_last_computed_token`` into the current builder's persistent
buffers and points the metadata at them.
I read the PR description (root cause and fix as quoted above) and a later ``mamba_attn.py``; the diff
itself was not available to me, so ``update_block_table`` below is written from the description.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/34874"
FAMILY = "persistent-buffer mutation"
KIND = "stale-input"
SITE = "update_block_table"
SYMPTOM = "Mamba 'all' prefix-cache mode under FULL graphs: later groups read/write the wrong state blocks"

VOCAB, DIM, STATE = 16, 4, 4
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 2, 12, 4       # mamba block = 2 tokens; 4 blocks per request
MAX_NUM_REQS = SIZE = 2                              # one FULL decode graph: 2 requests x 1 token
MAX_NUM_TOKENS = 8
NULL_BLOCK_ID = 0

_forward_context = SimpleNamespace(attn_metadata=None)


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    block_size: int
    state_shape: tuple
    mamba_cache_mode: str = "all"


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    max_query_len: int
    block_table_tensor: torch.Tensor


@dataclasses.dataclass
class Mamba2AttentionMetadata:
    num_prefills: int
    num_decodes: int
    num_reqs: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    state_indices_tensor: torch.Tensor               # 'all' mode: the request's block ids, [reqs, blocks]
    block_idx_last_scheduled_token: torch.Tensor     # column the new state is written to
    block_idx_last_computed_token: torch.Tensor      # column the initial state is read from


class Mamba2AttentionMetadataBuilder:
    def __init__(self, kv_cache_spec, layer_names, device, variant):
        self.kv_cache_spec, self.layer_names, self.device, self.variant = kv_cache_spec, layer_names, device, variant
        self.decode_cudagraph_max_bs = MAX_NUM_REQS
        # persistent buffers for FULL cudagraph decode
        self.state_indices_tensor = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.long, device=device)
        self.block_idx_last_scheduled_token = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_idx_last_computed_token = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)

    def build_for_cudagraph_capture(self, m):
        return self.build(0, m)

    def build(self, common_prefix_len, m):
        bs = self.kv_cache_spec.block_size
        query_lens = m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]
        num_computed = m.seq_lens_cpu - query_lens
        decode_only = m.max_query_len == 1
        md = Mamba2AttentionMetadata(
            num_prefills=0 if decode_only else m.num_reqs, num_decodes=m.num_reqs if decode_only else 0,
            num_reqs=m.num_reqs, query_start_loc_cpu=m.query_start_loc_cpu, seq_lens_cpu=m.seq_lens_cpu,
            state_indices_tensor=m.block_table_tensor[:m.num_reqs],
            block_idx_last_scheduled_token=((m.seq_lens_cpu + bs - 1) // bs - 1).to(self.device),
            block_idx_last_computed_token=((num_computed + bs - 1) // bs - 1).clamp(min=0).to(self.device))
        return self._update_metadata_for_cudagraph_capture(md)

    def _update_metadata_for_cudagraph_capture(self, md):
        """Decode-only batches use the persistent buffers (FULL cudagraphs are enabled in the config)."""
        if md.num_prefills == 0 and md.num_decodes <= self.decode_cudagraph_max_bs:
            n = md.num_decodes
            self.state_indices_tensor[:n].copy_(md.state_indices_tensor)
            self.block_idx_last_scheduled_token[:n].copy_(md.block_idx_last_scheduled_token)
            self.block_idx_last_computed_token[:n].copy_(md.block_idx_last_computed_token)
            md = dataclasses.replace(
                md, state_indices_tensor=self.state_indices_tensor[:n],
                block_idx_last_scheduled_token=self.block_idx_last_scheduled_token[:n],
                block_idx_last_computed_token=self.block_idx_last_computed_token[:n])
        return md

    def update_block_table(self, metadata, blk_table):
        """Reuse another group's metadata (same spec), with this group's block table."""
        state_indices_tensor = blk_table[:metadata.num_reqs]
        if not (metadata.num_prefills == 0 and metadata.num_decodes <= self.decode_cudagraph_max_bs):
            return dataclasses.replace(metadata, state_indices_tensor=state_indices_tensor)
        n = metadata.num_decodes
        self.state_indices_tensor[:n].copy_(state_indices_tensor)
        new_metadata = dataclasses.replace(metadata, state_indices_tensor=self.state_indices_tensor[:n])
        if self.variant == "fix":
            # Copy the block indices into this builder's persistent buffers as well: its CUDA graph
            # was captured reading them, not the first builder's.
            self.block_idx_last_scheduled_token[:n].copy_(metadata.block_idx_last_scheduled_token)
            self.block_idx_last_computed_token[:n].copy_(metadata.block_idx_last_computed_token)
            new_metadata = dataclasses.replace(
                new_metadata, block_idx_last_scheduled_token=self.block_idx_last_scheduled_token[:n],
                block_idx_last_computed_token=self.block_idx_last_computed_token[:n])
        return new_metadata


class MambaMixer2:
    """A one-state-per-token recurrence h = decay * h + x B, y = h C, with 'all'-mode block states."""

    def __init__(self, layer_name, gen, device):
        self.layer_name = layer_name
        self.decay = torch.sigmoid(randn(STATE, gen=gen, device=device))
        self.B = randn(DIM, STATE, gen=gen, device=device, scale=0.6)
        self.C = randn(STATE, DIM, gen=gen, device=device, scale=0.6)

    def forward(self, x, ssm_state):
        md = _forward_context.attn_metadata[self.layer_name]
        if md.num_prefills == 0:
            return self._forward_decode(x, ssm_state, md)
        return self._forward_prefill(x, ssm_state, md)

    def _forward_decode(self, x, ssm_state, md):
        # selective_state_update: initial state from the last computed block, new state into the
        # block of the last scheduled token
        src = md.state_indices_tensor.gather(1, md.block_idx_last_computed_token[:, None]).squeeze(1)
        dst = md.state_indices_tensor.gather(1, md.block_idx_last_scheduled_token[:, None]).squeeze(1)
        h = ssm_state[src] * self.decay + x @ self.B
        ssm_state[dst] = h
        return h @ self.C

    def _forward_prefill(self, x, ssm_state, md):
        qsl, seq = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
        outs = []
        for r in range(md.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            computed = seq[r] - (end - start)
            h = torch.zeros(STATE, device=x.device) if computed == 0 else \
                ssm_state[md.state_indices_tensor[r, md.block_idx_last_computed_token[r]]]
            for t in range(start, end):
                pos = computed + t - start
                h = h * self.decay + x[t] @ self.B
                outs.append(h @ self.C)
                if pos % BLOCK_SIZE == BLOCK_SIZE - 1 or t == end - 1:    # 'all' mode: a state per block
                    ssm_state[md.state_indices_tensor[r, pos // BLOCK_SIZE]] = h
        return torch.stack(outs)


class NemotronHModel:
    def __init__(self, device):
        gen = generator(34874)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.layers = [MambaMixer2(f"model.layers.{i}.mixer", gen, device) for i in range(2)]
        self.head = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def forward(self, input_ids, ssm_states):
        h = self.emb[input_ids]
        for layer, ssm_state in zip(self.layers, ssm_states):
            h = h + layer.forward(h, ssm_state)
        return h @ self.head


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        spec = MambaSpec(BLOCK_SIZE, (STATE,))           # every Mamba group has the same spec
        self.kv_cache_groups = [(spec, [layer.layer_name]) for layer in model.layers]
        self.builders = [Mamba2AttentionMetadataBuilder(spec, names, device, variant)
                         for spec, names in self.kv_cache_groups]
        self.ssm_states = [torch.zeros(NUM_BLOCKS, STATE, device=device) for _ in self.kv_cache_groups]
        self.block_tables = [torch.full((MAX_NUM_REQS, MAX_BLOCKS), NULL_BLOCK_ID, dtype=torch.long,
                                        device=device) for _ in self.kv_cache_groups]
        self.input_ids = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.requests = {}
        if graphed:
            self.capture_model()

    def _common(self, group, query_lens, seq_lens):
        qsl = torch.tensor([0] + query_lens).cumsum(0)
        return CommonAttentionMetadata(query_start_loc_cpu=qsl, seq_lens_cpu=torch.tensor(seq_lens),
                                       num_reqs=len(query_lens), max_query_len=max(query_lens),
                                       block_table_tensor=self.block_tables[group])

    def _build_attention_metadata(self, query_lens, seq_lens, for_cudagraph_capture=False):
        attn_metadata, cached = {}, {}
        for g, ((spec, layer_names), builder) in enumerate(zip(self.kv_cache_groups, self.builders)):
            common = self._common(g, query_lens, seq_lens)
            if for_cudagraph_capture:
                metadata = builder.build_for_cudagraph_capture(common)
            else:
                cache_key = (spec, type(builder))
                if cache_key in cached:
                    metadata = builder.update_block_table(cached[cache_key], common.block_table_tensor)
                else:
                    metadata = cached[cache_key] = builder.build(0, common)
            for name in layer_names:
                attn_metadata[name] = metadata
        return attn_metadata

    def capture_model(self):
        # _dummy_run(SIZE, uniform_decode=True): one token per request, block tables on the null block
        _forward_context.attn_metadata = self._build_attention_metadata([1] * SIZE, [1] * SIZE,
                                                                        for_cudagraph_capture=True)
        static = {"input_ids": self.input_ids}
        for g, b in enumerate(self.builders):
            static.update({f"group{g}.state_indices_tensor": b.state_indices_tensor,
                           f"group{g}.block_idx_last_scheduled_token": b.block_idx_last_scheduled_token,
                           f"group{g}.block_idx_last_computed_token": b.block_idx_last_computed_token})
        self.graph, self.out = capture(
            lambda: self.model.forward(self.input_ids[:SIZE], self.ssm_states), device=self.device,
            owner="GPUModelRunner (FULL decode graph)", static=static,
            state={f"ssm_state.group{g}": s for g, s in enumerate(self.ssm_states)})

    def execute_model(self, scheduled):
        """``scheduled``: (req_id, token ids) per request; a new request also gives its block ids per group."""
        tokens, query_lens, seq_lens = [], [], []
        for i, (req_id, token_ids, *blocks) in enumerate(scheduled):
            if blocks:
                self.requests[req_id] = {"num_computed": 0, "blocks": blocks[0]}
            req = self.requests[req_id]
            for g, table in enumerate(self.block_tables):
                row = req["blocks"][g] + [NULL_BLOCK_ID] * (MAX_BLOCKS - len(req["blocks"][g]))
                table[i].copy_(torch.tensor(row, device=self.device))
            tokens += token_ids
            query_lens.append(len(token_ids))
            seq_lens.append(req["num_computed"] + len(token_ids))
            req["num_computed"] += len(token_ids)
        n = len(tokens)
        self.input_ids[:n].copy_(torch.tensor(tokens, device=self.device))
        attn_metadata = self._build_attention_metadata(query_lens, seq_lens)
        uniform_decode = max(query_lens) == 1 and n == SIZE
        if self.graphed and uniform_decode:
            return replay(self.graph, self.out)[:n].clone()
        _forward_context.attn_metadata = attn_metadata
        return self.model.forward(self.input_ids[:n], self.ssm_states).clone()


def run(variant: str, device: str = "cpu"):
    model = NemotronHModel(device)

    def serve(graphed: bool):
        runner = GPUModelRunner(model, device, variant, graphed)
        # block ids per KV-cache group (each group has its own Mamba state cache)
        a_blocks, b_blocks = ([1, 2, 3, 4], [2, 4, 6, 8]), ([5, 6, 7, 8], [1, 3, 5, 7])
        outs = [runner.execute_model([("A", [3, 7, 1], a_blocks), ("B", [5, 9], b_blocks)])]   # prefill
        for a_tok, b_tok in ((2, 11), (4, 6), (13, 8), (10, 12), (1, 14)):                   # decodes
            outs.append(runner.execute_model([("A", [a_tok]), ("B", [b_tok])]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
