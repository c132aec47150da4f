"""Colocated RL: the manual weight offload rebinds every vLLM ``param.data``; the rollout graph keeps the old addresses.

Upstream: https://github.com/Snowflake-AI-Research/Arctic-Platform/pull/8 ("Fix rollout-compile grad-norm
explosion in colocate by offloading weights via cumem", commit 1f9cee17); the offload it turns off is
``offload_model_weights`` / ``backload_model_weights`` of ArcticInference's weight-sync receiver.
Symptom: colocated RL training (trainer and vLLM rollout on the same GPUs) with rollout compilation on
(``enforce_eager=False``, CUDA graphs) had its grad norm explode: the rollouts were sampled from stale or
garbage weights; with ``enforce_eager=True`` training was fine (June 2026).
Mechanism: ``sleep_inference`` called ``pool.sleep(level, offload_weights=colocate)``. On each worker
``offload_model_weights`` saves every parameter to host memory and replaces it with
``p.data = torch.zeros(1, device="cpu")``, releasing the GPU storage the captured decode graph reads by
address. The trainer then wakes and allocates its own tensors, which the allocator places in the freed
blocks. On the next weights wake ``backload_model_weights`` rebinds ``param.data =
cpu_tensor.to(device)``, fresh storage at new addresses, and the CUDA-IPC weight sync copies the new
policy into those. Eager code reads ``param.data`` and sees the new weights; the graph replays its
kernels on the old addresses and reads whatever the trainer left there.
Doctor: dangling-reference, at ``offload_model_weights`` (it releases the weights' storage while the
rollout graph still addresses it).
Fix (upstream): ``sleep_inference`` passes ``offload_weights=False``: vLLM's ``CuMemAllocator`` sleep
offloads the weights and frees only the physical pages, keeping each weight at its virtual address, so
the graph's addresses stay the parameters' own; the later ``restore_weights=True`` wake finds nothing to
restore and the IPC sync writes in place.
Read: the diff (two call sites) and ``offload_model_weights`` / ``backload_model_weights`` /
``InferenceWorker.sleep`` of ArcticInference. Not modelled: ``torch.cuda.empty_cache()`` in the offload
and the training workers' cache release before a wake (on CUDA they could unmap the freed blocks, a
fault instead of garbage); the trainer is a stand-in with DeepSpeed-like flat fp32 master weights and
per-parameter gradient buffers; the model is a tiny tied-embedding decoder without a KV cache.
"""
from __future__ import annotations

import torch

from workbench.engine import host, reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/Snowflake-AI-Research/Arctic-Platform/pull/8"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "offload_model_weights"
SYMPTOM = "colocated RL rollouts replay on released weight addresses: stale/garbage policy, grad norm explodes"

VOCAB, DIM = 16, 6             # weights of distinct byte sizes: [16, 6], [6, 6], [6]
MAX_NUM_SEQS, ROLLOUT_LEN, RL_STEPS, LR = 4, 3, 2, 0.5


def to_host(t: torch.Tensor, device) -> torch.Tensor:
    """``t.to("cpu")`` of a device tensor: a host copy (pinned on CUDA)."""
    return host(t.detach().cpu().clone(), device)


class Qwen2ForCausalLM(torch.nn.Module):
    """Tied embeddings, one RMS-normed MLP block."""

    def __init__(self, device):
        super().__init__()
        gen = generator(8)
        self.embed_tokens = torch.nn.Parameter(randn(VOCAB, DIM, gen=gen, device=device), requires_grad=False)
        self.mlp = torch.nn.Parameter(randn(DIM, DIM, gen=gen, device=device, scale=0.6), requires_grad=False)
        self.norm = torch.nn.Parameter(1.0 + randn(DIM, gen=gen, device=device, scale=0.1), requires_grad=False)

    def forward(self, input_ids):
        h = self.embed_tokens[input_ids]
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        h = h + torch.tanh(x @ self.mlp)
        return h @ self.embed_tokens.T


class CuMemAllocator:
    """vLLM's sleep-mode allocator for the ``weights`` tag: ``sleep`` backs the bytes up to host memory
    and unmaps the physical pages, ``wake_up`` maps them again at the same virtual addresses and
    restores the bytes. It knows its allocations by address: a parameter rebound elsewhere is no
    longer one of them."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.addresses = {name: p.data_ptr() for name, p in model.named_parameters()}
        self.backup = {}

    def sleep(self, level: int):
        for name, p in self.model.named_parameters():
            if p.data_ptr() == self.addresses[name]:
                self.backup[name] = to_host(p.data, self.device)

    def wake_up(self, tags):
        if tags is None or "weights" in tags:
            params = dict(self.model.named_parameters())
            for name, saved in self.backup.items():
                params[name].data.copy_(saved)          # same address: the graph's
            self.backup = {}


class WorkerExtension:
    """ArcticInference's weight-sync receiver methods, run inside each vLLM worker."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self._offloaded_state = {}

    def offload_model_weights(self):
        """Move vLLM model weights to CPU to free GPU for training."""
        self._offloaded_state = {}
        for name, p in self.model.named_parameters():
            self._offloaded_state[name] = to_host(p.data, self.device)
            p.data = torch.zeros(1, dtype=p.dtype, device="cpu")     # the GPU storage is released
        return {"status": "offloaded"}

    def backload_model_weights(self):
        """Restore vLLM model weights from CPU: fresh GPU storage for every parameter."""
        if not self._offloaded_state:
            return {"status": "nothing_to_restore"}
        param_dict = dict(self.model.named_parameters())
        for name, cpu_tensor in self._offloaded_state.items():
            param_dict[name].data = cpu_tensor.to(self.device)
        self._offloaded_state = {}
        return {"status": "restored"}

    def load_weights_cuda_ipc_chunk(self, name, tensor):
        """``_DirectParamWriter``: the received weight is copied into the live parameter in place."""
        view = dict(self.model.named_parameters())[name].data
        view.copy_(tensor)


class GPUModelRunner:
    """vLLM's runner: the decode step captured at engine start (full CUDA graph), then replayed."""

    def __init__(self, model, device, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        self.input_ids = torch.zeros(MAX_NUM_SEQS, dtype=torch.long, device=device)
        if graphed:
            self.graph, self.logits = capture(
                lambda: self.model(self.input_ids), device=device, warmups=1, on_freed="reuse",
                owner="GPUModelRunner (rollout decode graph)", static={"input_ids": self.input_ids})

    def execute_model(self, token_ids):
        self.input_ids.copy_(token_ids)
        if not self.graphed:
            return self.model(self.input_ids)
        return replay(self.graph, self.logits)


class InferenceWorker:
    def __init__(self, model, device, graphed):
        self.model = model
        self.runner = GPUModelRunner(model, device, graphed)
        self.ext = WorkerExtension(model, device)
        self.allocator = CuMemAllocator(model, device)

    def generate(self, prompts):
        tokens, outs = prompts, []
        for _ in range(ROLLOUT_LEN):
            logits = self.runner.execute_model(tokens).clone()
            outs.append(logits)
            tokens = logits.argmax(-1)
        return outs

    def sleep(self, level=1, offload_weights=False):
        if offload_weights:
            self.ext.offload_model_weights()
        self.allocator.sleep(level)

    def wake_up(self, tags=None, restore_weights=False):
        if restore_weights:
            self.ext.backload_model_weights()
        self.allocator.wake_up(tags)


class DeepSpeedWorker:
    """The colocated trainer: fp32 master weights flattened on the host while asleep; awake, a flat
    device copy and one gradient buffer per parameter (allocated after vLLM went to sleep)."""

    def __init__(self, model, device):
        self.device = device
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.flat_master = to_host(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), device)
        self.flat, self.grads = None, {}

    def _views(self):
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = shape.numel()
            out[name] = self.flat[offset:offset + n].view(shape)
            offset += n
        return out

    def wake(self):
        self.flat = self.flat_master.to(self.device)

    def train_step(self, rollout_tokens, step):
        params = self._views()
        counts = torch.zeros(VOCAB, device=self.device).index_add_(
            0, rollout_tokens.reshape(-1), torch.ones(rollout_tokens.numel(), device=self.device))
        for name in self.names:                 # gradient buffers: new tensors of the parameters' shapes
            g = torch.sin(params[name] * (step + 2.0))
            if name == "embed_tokens":
                g = g * counts[:, None] / rollout_tokens.numel()
            self.grads[name] = g
        for name in self.names:
            params[name].sub_(LR * self.grads[name])

    def get_cuda_ipc_handle(self, name):
        return self._views()[name]

    def sleep(self):
        self.flat_master.copy_(self.flat)
        self.flat, self.grads = None, {}


class ArcticRLServerState:
    def __init__(self, variant, worker, trainer, colocate=True):
        self.variant, self.worker, self.trainer, self.colocate = variant, worker, trainer, colocate

    def sleep_inference(self, level):
        offload_weights = self.colocate if self.variant == "bug" else False
        self.worker.sleep(level=level, offload_weights=offload_weights)

    def wake_inference(self, tags=None, restore_weights=None):
        if restore_weights is None:
            restore = self.colocate and (tags is None or "weights" in tags)
        else:
            restore = restore_weights
        self.worker.wake_up(tags=tags, restore_weights=restore)

    def sync_weights_cuda_ipc(self):
        # Staged wake: weights only (restoring the manual offload), per-parameter IPC load, then KV cache.
        self.wake_inference(tags=["weights"], restore_weights=True)
        for name in self.trainer.names:
            self.worker.ext.load_weights_cuda_ipc_chunk(name, self.trainer.get_cuda_ipc_handle(name))
        self.trainer.sleep()
        self.wake_inference(tags=["kv_cache"])


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (MAX_NUM_SEQS,), generator=gen) for _ in range(RL_STEPS + 1)]

    def train(graphed: bool):
        model = Qwen2ForCausalLM(device)
        server = ArcticRLServerState(variant, InferenceWorker(model, device, graphed), DeepSpeedWorker(model, device))
        outs = []
        for step in range(RL_STEPS):
            rollout = server.worker.generate(prompts[step].to(device))      # sample with the current policy
            outs += rollout
            server.sleep_inference(level=1)
            server.trainer.wake()
            server.trainer.train_step(torch.stack([r.argmax(-1) for r in rollout]), step)
            server.sync_weights_cuda_ipc()
        outs += server.worker.generate(prompts[RL_STEPS].to(device))
        return outs

    def served():
        with reuse_freed_blocks():          # a freed block goes to the next allocation of its size
            return train(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: train(False))
