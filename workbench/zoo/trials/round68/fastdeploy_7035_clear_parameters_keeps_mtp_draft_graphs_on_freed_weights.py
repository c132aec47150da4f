"""RL clear_parameters() frees the MTP draft model's weights and KV cache but keeps its CUDA graphs; after the update they replay on the freed memory.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/7035 ("[BugFix] Fix clear_parameters in draft cudagraph",
commit 6693bcd0e, March 2026). An earlier, never merged attempt: #5024 ("[GraphOptimization] Clear graphs of Draft
model in RL"); follow-up #7378 ("[RL] Add clear_graph_opt_backend for glm4_mtp") adds the method to a draft model.
Symptom: RL with MTP speculative decoding and ``draft_model_use_cudagraph``: after each clear/update weight cycle
the draft model keeps running the graphs captured on the previous round's weights and draft KV cache -- freed
memory: CUDA error 700 (illegal memory access) while recapturing, or silently wrong draft tokens. The PR text is
only the template.
Mechanism: ``GPUModelRunner.clear_parameters`` (fastdeploy/worker/gpu_model_runner.py) clears the graphs of the
target model only (``self.model.clear_grpah_opt_backend()`` -> ``CudaGraphPiecewiseBackend.clear_graph``, which
rebuilds ``concrete_size_entries``), then ``DynamicWeightManager.clear_parameters`` runs ``param._clear_data()`` on
the parameters of ``[self.model, self.proposer.model]``, ``MTPProposer.clear_mtp_cache`` drops the draft KV cache
and ``empty_cache`` returns the memory. ``update_parameters`` shares the trainer's new tensors into the parameters
(``_share_buffer_to``: new addresses), allocates a new draft cache (``proposer.initialize_kv_cache``) and calls
``capture_model``. In ``CudaGraphPiecewiseBackend.__call__`` a graph is captured only when ``entry.cuda_graph is
None``; the draft model's entries still hold their old graphs, so the "capture" dummy runs and every later draft
step just ``entry.cuda_graph.replay()``: kernels that read the released weights (and the old cache). Eager
drafting reads the new parameters and ``forward_meta.caches``, so only the graph path is wrong.
Doctor: dangling-reference, at ``clear_parameters`` (it releases the draft model's weights while the draft's
captured graphs, which only hold their addresses, stay alive and are replayed after the update).
Fix (upstream): the MTP branch of ``clear_parameters`` calls ``self.proposer.model.clear_grpah_opt_backend()``
before ``self.proposer.clear_mtp_cache()``, so ``capture_model`` recaptures the draft on the new memory (also
resets ``ProposerInputBatch.index_to_batch_id``, incidental).
Modelled: one attention layer per model over a paged KV cache, decode only, batches equal to capture sizes (no
padding); the dummy run writes the null block; the draft's ``clear_grpah_opt_backend`` is the one-line method
#5024/#7378 add to the draft model classes; sampling and acceptance left out (outputs: target and draft logits). The captured step's closure keeps the
old draft cache referenced here, so the released draft weights are what the stale replay trips on. Note: as
merged, #7035 calls a method that only glm4_mtp gained (#7378); the modelled fix assumes the draft has it.
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.zoo.kit import capture, compare, generator, randn, release_to_driver, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/7035"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "clear_parameters"
SYMPTOM = "after an RL weight update the MTP draft model replays graphs captured on freed weights and KV cache"

VOCAB, HIDDEN, BLOCK_SIZE, MAX_BLOCKS = 16, 8, 2, 4
MAX_NUM_SEQS, MAX_LEN = 4, BLOCK_SIZE * MAX_BLOCKS
NUM_BLOCKS = 1 + MAX_NUM_SEQS * MAX_BLOCKS                 # block 0: the null block of the dummy run
CUDAGRAPH_CAPTURE_SIZES = (4, 2)
STEPS = ((0, 1, 2, 3), (0, 2), (0, 1, 2, 3))             # sequences decoded at each step of a round


class ForwardMeta:
    def __init__(self, ids_remove_padding, seq_lens_decoder, block_tables, caches, step_use_cudagraph=False):
        self.ids_remove_padding, self.seq_lens_decoder, self.block_tables = ids_remove_padding, seq_lens_decoder, block_tables
        self.caches, self.step_use_cudagraph = caches, step_use_cudagraph


class ConcreteSizeEntry:
    """Record the concrete information corresponding to the current shape (num_tokens)."""

    def __init__(self, real_shape):
        self.real_shape, self.runnable, self.num_finished_warmup = real_shape, None, 0
        self.cuda_graph, self.output_buffers = None, []


class CudaGraphPiecewiseBackend:
    def __init__(self, dy_runnable, device, name):
        self.dy_runnable, self.device, self.name, self.warm_up_size = dy_runnable, device, name, 1
        self._create_entry_dict()

    def _create_entry_dict(self):
        self.concrete_size_entries = {s: ConcreteSizeEntry(real_shape=s) for s in CUDAGRAPH_CAPTURE_SIZES}

    def __call__(self, **kwargs):
        fm = kwargs["forward_meta"]
        real_shape = fm.ids_remove_padding.shape[0]
        entry = self.concrete_size_entries[real_shape]
        if entry.runnable is None:
            entry.runnable = self.dy_runnable
        if entry.cuda_graph is None:                     # capture only for an empty entry
            g, out = capture(lambda e=entry, kw=kwargs: e.runnable(**kw), device=self.device,
                             warmups=self.warm_up_size, name=f"{self.name} shape {real_shape}",
                             owner="CudaGraphPiecewiseBackend",
                             static={"ids_remove_padding": fm.ids_remove_padding, "seq_lens_decoder": fm.seq_lens_decoder,
                                     "block_tables": fm.block_tables},
                             state={f"cache_{i}": c for i, c in enumerate(fm.caches)})
            entry.cuda_graph, entry.output_buffers = g, [out]
        return replay(entry.cuda_graph, entry.output_buffers[0])

    def clear_graph(self):
        for entry in self.concrete_size_entries.values():
            if entry.cuda_graph:
                del entry.cuda_graph
        del self.concrete_size_entries
        self._create_entry_dict()


class GraphOptBackend:
    def __init__(self, runnable, device, use_cudagraph, name):
        self.runnable, self.use_cudagraph = runnable, use_cudagraph
        self.cudagraph_piecewise_backend = CudaGraphPiecewiseBackend(runnable, device, name)

    def __call__(self, **kwargs):
        if not self.use_cudagraph or not kwargs["forward_meta"].step_use_cudagraph:
            return self.runnable(**kwargs)
        return self.cudagraph_piecewise_backend(**kwargs)

    def clear_cudagraph_piecewise_backend(self):
        self.cudagraph_piecewise_backend.clear_graph()


def _param(gen, device, *shape, scale=0.5):
    return nn.Parameter(randn(*shape, gen=gen, device=device, scale=scale), requires_grad=False)


def attention(layer, h, forward_meta):
    """Append this token's k/v at its slot, then attend over the sequence's pages up to its position."""
    k_cache, v_cache = forward_meta.caches
    n = h.shape[0]
    pos, table = forward_meta.seq_lens_decoder[:n].long(), forward_meta.block_tables[:n].long()
    slot = table.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1) * BLOCK_SIZE + pos % BLOCK_SIZE
    k_cache[slot] = h @ layer.wk
    v_cache[slot] = h @ layer.wv
    ctx = torch.arange(MAX_LEN, device=h.device)
    slots = table[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    scores = (k_cache[slots] @ (h @ layer.wq)[:, :, None]).squeeze(-1)
    scores = scores.masked_fill(ctx[None, :] > pos[:, None], -1e9)
    return h + (torch.softmax(scores, -1)[:, :, None] * v_cache[slots]).sum(1) @ layer.wo


class Layer(nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (_param(gen, device, HIDDEN, HIDDEN) for _ in range(4))


class Ernie4_5_Model(nn.Module):                                   # @support_graph_optimization
    def __init__(self, gen, device, use_cudagraph):
        super().__init__()
        self.embed_tokens, self.layer = _param(gen, device, VOCAB, HIDDEN, scale=1.0), Layer(gen, device)
        self.graph_opt_backend = GraphOptBackend(self.forward, device, use_cudagraph, "target")

    def forward(self, ids_remove_padding, forward_meta):
        return attention(self.layer, self.embed_tokens[ids_remove_padding], forward_meta)

    def clear_grpah_opt_backend(self):
        self.graph_opt_backend.clear_cudagraph_piecewise_backend()


class Ernie4_5_MTPModel(nn.Module):                                # @support_graph_optimization
    def __init__(self, gen, device, use_cudagraph):
        super().__init__()
        self.embed_tokens, self.layer = _param(gen, device, VOCAB, HIDDEN, scale=1.0), Layer(gen, device)
        self.eh_proj = _param(gen, device, 2 * HIDDEN, HIDDEN)
        self.graph_opt_backend = GraphOptBackend(self.forward, device, use_cudagraph, "draft")

    def forward(self, ids_remove_padding, previous_hidden_states, forward_meta):
        h = torch.cat([self.embed_tokens[ids_remove_padding], previous_hidden_states], -1) @ self.eh_proj
        return attention(self.layer, h, forward_meta)

    def clear_grpah_opt_backend(self):
        self.graph_opt_backend.clear_cudagraph_piecewise_backend()


class Ernie4_5_MoeForCausalLM(nn.Module):
    def __init__(self, gen, device, use_cudagraph):
        super().__init__()
        self.ernie = Ernie4_5_Model(gen, device, use_cudagraph)
        self.lm_head = _param(gen, device, HIDDEN, VOCAB)

    def forward(self, **kwargs):
        return self.ernie.graph_opt_backend(**kwargs)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head

    def clear_grpah_opt_backend(self):
        self.ernie.clear_grpah_opt_backend()


class Ernie4_5_MTPForCausalLM(Ernie4_5_MoeForCausalLM):
    def __init__(self, gen, device, use_cudagraph, sharing_model):
        nn.Module.__init__(self)
        self.ernie = Ernie4_5_MTPModel(gen, device, use_cudagraph)
        self.lm_head = sharing_model.lm_head                       # shared with the target model


class DynamicWeightManager:
    def __init__(self, models):
        self.state_dict = {f"{i}.{n}": p for i, m in enumerate(models) for n, p in m.named_parameters()}

    def clear_parameters(self, pid=0):
        for param in self.state_dict.values():
            param.data = torch.empty(0, device=param.device)       # param._clear_data()

    def update_parameters(self, state_dict, pid=0):
        for name, new_param in state_dict.items():
            self.state_dict[name].data = new_param                 # new_param._share_buffer_to(target_param)


def trainer_state(models, round_, device):
    """The trainer's refreshed weights for this round (IPC-shared tensors, owned by the trainer)."""
    gen = generator(7035 + round_)
    return {f"{i}.{n}": randn(*p.shape, gen=gen, device=device, scale=0.5)
            for i, m in enumerate(models) for n, p in m.named_parameters() if n != "lm_head" or i == 0}


def new_caches(device):
    return [torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device) for _ in range(2)]


class MTPProposer:
    def __init__(self, main_model, share_inputs, device, use_cudagraph):
        self.device, self.draft_model_use_cudagraph = device, use_cudagraph
        self.model = Ernie4_5_MTPForCausalLM(generator(71), device, use_cudagraph, main_model)
        self.model_inputs = {"target_hidden_states": torch.zeros(MAX_NUM_SEQS, HIDDEN, device=device), **share_inputs}
        self.cache_kvs_map, self.forward_meta = {}, None

    def initialize_kv_cache(self):
        caches = new_caches(self.device)
        self.cache_kvs_map = {"key_caches_1": caches[0], "value_caches_1": caches[1]}
        self.model_inputs["caches"] = caches

    def clear_mtp_cache(self):
        self.cache_kvs_map.clear()
        del self.model_inputs["caches"]
        if self.forward_meta is not None:
            del self.forward_meta.caches

    def run(self, full_hidden_states, step_use_cudagraph):
        n, mi = full_hidden_states.shape[0], self.model_inputs
        mi["target_hidden_states"][:n].copy_(full_hidden_states)
        self.forward_meta = ForwardMeta(mi["input_ids"][:n], mi["seq_lens_decoder"], mi["block_tables"], mi["caches"],
                                        step_use_cudagraph and self.draft_model_use_cudagraph)
        hidden = self.model(ids_remove_padding=self.forward_meta.ids_remove_padding,
                            previous_hidden_states=mi["target_hidden_states"][:n], forward_meta=self.forward_meta)
        return self.model.compute_logits(hidden)


class GPUModelRunner:
    def __init__(self, device, variant, use_cudagraph):
        self.device, self.variant, self.use_cudagraph = device, variant, use_cudagraph
        self.share_inputs = {"input_ids": torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device),
                             "seq_lens_decoder": torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=device),
                             "block_tables": torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS, dtype=torch.int32, device=device)}
        self.model = Ernie4_5_MoeForCausalLM(generator(70), device, use_cudagraph)
        self.proposer = MTPProposer(self.model, self.share_inputs, device, use_cudagraph)
        self.dynamic_weight_manager = DynamicWeightManager([self.model, self.proposer.model])
        self.proposer.initialize_kv_cache()
        self.initialize_kv_cache()
        self.capture_model()

    def initialize_kv_cache(self):
        self.share_inputs["caches"] = new_caches(self.device)

    def clear_cache(self):
        self.share_inputs.pop("caches", None)

    def _run_step(self, n, step_use_cudagraph):
        si = self.share_inputs
        forward_meta = ForwardMeta(si["input_ids"][:n], si["seq_lens_decoder"], si["block_tables"], si["caches"],
                                   step_use_cudagraph and self.use_cudagraph)
        hidden = self.model(ids_remove_padding=forward_meta.ids_remove_padding, forward_meta=forward_meta)
        logits = self.model.compute_logits(hidden)
        return logits, self.proposer.run(hidden, forward_meta.step_use_cudagraph)

    def _dummy_run(self, batch_size):
        self.share_inputs["input_ids"][:batch_size] = 5
        self.share_inputs["seq_lens_decoder"][:batch_size] = 0
        self.share_inputs["block_tables"][:batch_size] = 0          # the null block
        self._run_step(batch_size, step_use_cudagraph=True)

    def capture_model(self):
        if not self.use_cudagraph:
            return
        for batch_size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            self._dummy_run(batch_size)

    def execute_model(self, ids, positions, tables):
        n = len(ids)
        self.share_inputs["input_ids"][:n].copy_(ids)
        self.share_inputs["seq_lens_decoder"][:n].copy_(positions)
        self.share_inputs["block_tables"][:n].copy_(tables)
        return [t.clone() for t in self._run_step(n, step_use_cudagraph=True)]

    def clear_parameters(self, pid=0):
        if self.use_cudagraph:
            self.model.clear_grpah_opt_backend()                   # the target model's graphs only
        self.dynamic_weight_manager.clear_parameters(pid)
        if self.variant == "fix":
            self.proposer.model.clear_grpah_opt_backend()          # #7035
        self.proposer.clear_mtp_cache()
        self.clear_cache()
        release_to_driver(self.device)                             # paddle.device.cuda.empty_cache()

    def update_parameters(self, state_dict, pid=0):
        self.dynamic_weight_manager.update_parameters(state_dict, pid)
        self.proposer.initialize_kv_cache()
        self.initialize_kv_cache()
        if self.use_cudagraph:
            self.capture_model()


def run(variant: str, device: str = "cpu"):
    gen = generator(70350)
    tokens = torch.randint(0, VOCAB, (3, len(STEPS), MAX_NUM_SEQS), generator=gen)

    def serve(graphed: bool):
        runner, outs = GPUModelRunner(device, variant, graphed), []
        for round_ in range(3):
            if round_:                                             # an RL weight update between rollouts
                trainer = trainer_state([runner.model, runner.proposer.model], round_, device)
                runner.clear_parameters()
                runner.update_parameters(trainer)
            kv_lens = [0] * MAX_NUM_SEQS
            for step, seqs in enumerate(STEPS):
                ids = tokens[round_, step, list(seqs)]
                pos = torch.tensor([kv_lens[s] for s in seqs], dtype=torch.int32)
                tables = torch.tensor([[1 + s * MAX_BLOCKS + b for b in range(MAX_BLOCKS)] for s in seqs],
                                      dtype=torch.int32)
                outs += runner.execute_model(ids.to(device), pos.to(device), tables.to(device))
                for s in seqs:
                    kv_lens[s] += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
