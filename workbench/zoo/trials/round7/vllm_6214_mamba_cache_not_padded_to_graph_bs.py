"""Jamba's Mamba state is gathered for the real requests only and copied into the padded graph buffer.

Upstream: https://github.com/vllm-project/vllm/pull/6214 ("[Bugfix] Mamba cache Cuda Graph padding").
Symptom: Jamba with CUDA graphs fails on any decode batch whose size was not captured and is padded up to a
captured one: ``RuntimeError`` with incompatible tensor shapes (vLLM v0, July 2024).
Mechanism: the v0 ``CUDAGraphRunner`` pads a decode batch of ``n`` sequences to the next captured size,
and Jamba's graph reads its Mamba conv/SSM states from ``seqlen_agnostic_capture_inputs``, buffers sliced to
that padded size. Before each replay ``copy_inputs_before_cuda_graphs`` gathers the running requests' states
with ``_prepare_current_run_mamba_cache``, which returned one row per real request only. The
``[layers, n, ...]`` gather is copied into the ``[layers, batch_size, ...]`` buffer: the shapes do not match
and the step fails (for ``n == 1`` the row is silently broadcast into every padded row).
Doctor: padded-shape-mismatch, at ``copy_inputs_before_cuda_graphs`` (the copy of the real-row gather into the
padded capture buffer).
Fix (upstream): ``_prepare_current_run_mamba_cache`` takes the graph's batch size
(``input_buffers['input_ids'].shape[0]``) and pads the gathered indices with a free cache index, so the
gathered state has one row per graph row; ``copy_outputs_after_cuda_graphs`` still copies back only the
real requests' rows.
"""
from __future__ import annotations

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/6214"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "copy_inputs_before_cuda_graphs"
SYMPTOM = "RuntimeError (incompatible tensor shapes) on every decode batch padded to a captured size"

VOCAB, DIM, D_CONV, D_STATE, MAMBA_LAYERS = 12, 4, 3, 2, 1
_BATCH_SIZES_TO_CAPTURE = [1, 2, 4]


class JambaModel:
    """One Mamba mixer (causal conv1d update + selective state update) between an embedding and a norm."""

    def __init__(self, device):
        gen = generator(6214)
        self.embed_tokens = randn(VOCAB, DIM, gen=gen, device=device)
        self.conv_weight = randn(DIM, D_CONV, gen=gen, device=device, scale=0.6)
        self.A = torch.sigmoid(randn(DIM, D_STATE, gen=gen, device=device))
        self.B = randn(DIM, D_STATE, gen=gen, device=device, scale=0.5)
        self.C = randn(DIM, D_STATE, gen=gen, device=device, scale=0.5)
        self.out_proj = randn(DIM, DIM, gen=gen, device=device, scale=0.7)

    def __call__(self, input_ids, positions, conv_state, ssm_state):
        x = self.embed_tokens[input_ids]
        conv = conv_state[0]                                   # [batch, DIM, D_CONV] of mamba layer 0
        conv.copy_(torch.cat([conv[:, :, 1:], x[:, :, None]], -1))          # causal_conv1d_update
        xc = torch.nn.functional.silu((conv * self.conv_weight).sum(-1))
        ssm = ssm_state[0]
        ssm.copy_(ssm * self.A + xc[:, :, None] * self.B)                   # selective_state_update
        y = (ssm * self.C).sum(-1)
        return x + y @ self.out_proj


class JambaForCausalLM:
    def __init__(self, device, padded: bool):
        self.device = device
        self.padded = padded                                   # the upstream fix
        self.model = JambaModel(device)
        self.lm_head = randn(DIM, VOCAB, gen=generator(6215), device=device, scale=0.5)
        self.current_indices: list[int] = []
        self.mamba_cache: tuple[torch.Tensor, torch.Tensor] = tuple()
        self.mamba_gc_cache_buffer: tuple[torch.Tensor, torch.Tensor] = tuple()
        self.mamba_cache_indices_mapping: dict[str, dict[int, int]] = {}

    def forward(self, input_ids, positions, **kwargs):
        if not self.mamba_cache:
            self._prepare_mamba_cache()
        if "seqlen_agnostic_capture_inputs" not in kwargs:
            # We get here only on Prefill/Eager mode runs
            request_ids_to_seq_ids = kwargs["request_ids_to_seq_ids"]
            batch_size = input_ids.shape[0]
            current_seqlen_agnostic_cache, indices = self._prepare_current_run_mamba_cache(
                request_ids_to_seq_ids, batch_size)
            self._release_mamba_cache(kwargs["finished_requests_ids"])
        else:
            # CUDA graph capturing runs
            current_seqlen_agnostic_cache, indices = kwargs["seqlen_agnostic_capture_inputs"], []
        self.current_indices = indices
        hidden_states = self.model(input_ids, positions, current_seqlen_agnostic_cache[0],
                                   current_seqlen_agnostic_cache[1])
        if "seqlen_agnostic_capture_inputs" not in kwargs:
            self._copy_mamba_cache_by_indices(self.current_indices, current_seqlen_agnostic_cache)
        return hidden_states

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head

    def _copy_mamba_cache_by_indices(self, indices, current_seqlen_agnostic_cache):
        for i, offset in enumerate(indices):
            for cache_t, from_buffer_t in zip(self.mamba_cache, current_seqlen_agnostic_cache):
                cache_t[:, offset].copy_(from_buffer_t[:, i])

    def _assign_seq_id_to_mamba_cache(self, cur_rid, seqs_id):
        indices_for_current_run = []
        for seq_id in seqs_id:
            if cur_rid not in self.mamba_cache_indices_mapping:
                self.mamba_cache_indices_mapping[cur_rid] = {seq_id: self._first_free_index_in_mamba_cache()}
            indices_for_current_run.append(self.mamba_cache_indices_mapping[cur_rid][seq_id])
        return indices_for_current_run

    def _prepare_current_run_mamba_cache(self, request_ids_to_seq_ids, batch_size):
        indices_for_current_run = []
        for request_id, seqs_id in request_ids_to_seq_ids.items():
            indices_for_current_run += self._assign_seq_id_to_mamba_cache(request_id, seqs_id)
        gathered = indices_for_current_run.copy()
        if self.padded:
            ## Pad the batch in case of running batch that was not captured via CG
            pad_index = self._first_free_index_in_mamba_cache()
            for _ in range(batch_size - len(indices_for_current_run)):
                gathered.append(pad_index)
        conv_state = self.mamba_cache[0][:, gathered]
        temporal_state = self.mamba_cache[1][:, gathered]
        return (conv_state, temporal_state), indices_for_current_run

    def copy_inputs_before_cuda_graphs(self, input_buffers, **kwargs):
        """Copy the relevant Mamba cache into the CUDA graph input buffer that was provided during the
        capture runs (JambaForCausalLM.mamba_gc_cache_buffer)."""
        request_ids_to_seq_ids = kwargs["request_ids_to_seq_ids"]
        cg_batch_size = input_buffers["input_ids"].shape[0]
        batch_size = cg_batch_size if self.padded else len(request_ids_to_seq_ids)
        current_mamba_cache, indices = self._prepare_current_run_mamba_cache(request_ids_to_seq_ids, batch_size)
        self.current_indices = indices
        self._release_mamba_cache(kwargs["finished_requests_ids"])
        for input_buffer, current_cache_buffer in zip(input_buffers["seqlen_agnostic_capture_inputs"],
                                                      current_mamba_cache):
            input_buffer.copy_(current_cache_buffer)

    def copy_outputs_after_cuda_graphs(self, input_buffers, **kwargs):
        """Copy the relevant Mamba cache from the CUDA graph input_buffers back to
        JambaForCausalLM.mamba_cache after the replay."""
        self._copy_mamba_cache_by_indices(self.current_indices, input_buffers["seqlen_agnostic_capture_inputs"])

    def get_seqlen_agnostic_capture_inputs(self, batch_size):
        return tuple(buffer[:, :batch_size] for buffer in self.mamba_gc_cache_buffer)

    def _release_mamba_cache(self, finished_seq_groups_req_ids):
        for req_id in finished_seq_groups_req_ids:
            self.mamba_cache_indices_mapping.pop(req_id, None)

    def _first_free_index_in_mamba_cache(self):
        occupied = {i for seq_ids in self.mamba_cache_indices_mapping.values() for i in seq_ids.values()}
        return next(i for i in range(self.mamba_cache[0].shape[1]) if i not in occupied)

    def _prepare_mamba_cache(self):
        max_batch_size = _BATCH_SIZES_TO_CAPTURE[-1] + 10
        for buffername in ["mamba_cache", "mamba_gc_cache_buffer"]:
            setattr(self, buffername, (torch.zeros(MAMBA_LAYERS, max_batch_size, DIM, D_CONV, device=self.device),
                                       torch.zeros(MAMBA_LAYERS, max_batch_size, DIM, D_STATE, device=self.device)))


class CUDAGraphRunner:
    def __init__(self, model: JambaForCausalLM):
        self.model = model
        self.graph = None
        self.input_buffers: dict = {}
        self.output = None

    def capture(self, input_ids, positions, memory_pool, **kwargs):
        self.input_buffers = {"input_ids": input_ids, "positions": positions, **kwargs}
        conv, ssm = kwargs["seqlen_agnostic_capture_inputs"]
        self.graph, self.output = capture(lambda: self.model.forward(input_ids, positions, **kwargs),
                                          device=str(input_ids.device), pool=memory_pool, warmups=2,
                                          name=f"bs {input_ids.shape[0]}",
                                          static={"input_ids": input_ids, "positions": positions},
                                          state={"conv_state": conv, "ssm_state": ssm}, owner="CUDAGraphRunner")

    def forward(self, input_ids, positions, real: int, **kwargs):
        self.input_buffers["input_ids"].copy_(input_ids)
        self.input_buffers["positions"].copy_(positions)
        self.model.copy_inputs_before_cuda_graphs(self.input_buffers, **kwargs)
        out = replay(self.graph, self.output, real=real, padded={})
        self.model.copy_outputs_after_cuda_graphs(self.input_buffers, **kwargs)
        return out


class ModelRunner:
    def __init__(self, device, padded: bool, enforce_eager: bool):
        self.device = device
        self.model = JambaForCausalLM(device, padded)
        self.enforce_eager = enforce_eager
        self.graph_runners: dict[int, CUDAGraphRunner] = {}

    def capture_model(self):
        max_batch_size = _BATCH_SIZES_TO_CAPTURE[-1]
        input_tokens = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        input_positions = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self.model._prepare_mamba_cache()
        pool = graph_pool_handle(self.device)
        for batch_size in reversed(_BATCH_SIZES_TO_CAPTURE):
            runner = CUDAGraphRunner(self.model)
            runner.capture(input_tokens[:batch_size], input_positions[:batch_size], pool,
                           seqlen_agnostic_capture_inputs=self.model.get_seqlen_agnostic_capture_inputs(batch_size))
            self.graph_runners[batch_size] = runner

    def execute_model(self, request_ids, tokens, positions, finished_requests_ids, is_prompt=False):
        batch_size = len(request_ids)
        kwargs = {"request_ids_to_seq_ids": {rid: [i] for i, rid in enumerate(request_ids)},
                  "finished_requests_ids": finished_requests_ids}
        input_ids = torch.tensor(tokens, device=self.device)
        input_pos = torch.tensor(positions, device=self.device)
        if self.enforce_eager or is_prompt:
            hidden_states = self.model.forward(input_ids, input_pos, **kwargs)
        else:
            graph_batch_size = next(bs for bs in _BATCH_SIZES_TO_CAPTURE if bs >= batch_size)
            pad = graph_batch_size - batch_size                  # padded decode rows: token 0, position 0
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            input_pos = torch.cat([input_pos, input_pos.new_zeros(pad)])
            hidden_states = self.graph_runners[graph_batch_size].forward(input_ids, input_pos, batch_size,
                                                                         **kwargs)[:batch_size]
        return self.model.compute_logits(hidden_states)


def schedule():
    """(request ids, tokens, positions, finished since the last step, is_prompt): a prompt step (eager),
    then decode batches of 4, 3 (D finished; runs the graph of 4), 2 and 1."""
    return [(["A", "B", "C", "D"], [3, 5, 7, 9], [0, 0, 0, 0], [], True),
            (["A", "B", "C", "D"], [1, 2, 4, 8], [1, 1, 1, 1], [], False),
            (["A", "B", "C"], [6, 10, 11], [2, 2, 2], ["D"], False),
            (["A", "B"], [2, 3], [3, 3], ["C"], False),
            (["A"], [4], [4], ["B"], False)]


def run(variant: str, device: str = "cpu"):
    padded = variant == "fix"

    def serve(enforce_eager: bool):
        runner = ModelRunner(device, padded, enforce_eager)
        if not enforce_eager:
            runner.capture_model()
        return [runner.execute_model(*step).clone() for step in schedule()]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
