"""apex's single-node group batch norm (``GroupBatchNorm2d``, cudnn_gbn) builds its cuDNN execution plan on every call, so a graph-captured training step tries to finalize a runtime-compiled cuDNN engine inside the capture and fails.

Upstream: https://github.com/NVIDIA/apex/pull/1685 ("Tkurth/sgbn fixes", NVIDIA/apex, by Thorsten Kurth (tkurth),
committed 2023-07-02 as merge commit 8ffc901e50bbf740fdb6d5bccb17f66a6ec8604e; its commit message: "this commit fixes
the SGBN graph capture problem by caching the cudnn plan and re-using it"; the PR text: it "fixes the single node group
batch norm in APEX to work with cuda 12.2 and RTC"; the superseded #1678 said "with recent RTC features, the old code
breaks under graph capture. The new implementation caches the plan and reuses it for FWD and BWD").
Read: the diff stat and message of 8ffc901e; ``apex/contrib/csrc/cudnn_gbn/cudnn_gbn.cpp`` at the parent (8ffc901e^:
``gbn_forward`` / ``gbn_backward`` calling ``run_batch_norm_forward`` / ``run_batch_norm_backward`` with the data
pointers) and at 8ffc901e (``static std::map<std::vector<int64_t>, ExecutionPlan> gbn_plan_cache`` keyed by
``{BN_FWD|BN_BWD, N, C, H, W, bn_group, CUDNN_DATA_HALF}``, ``execute_batch_norm_forward`` / ``_backward``);
``norm_sample.cpp`` at the parent (``run_batch_norm_forward``: tensor descriptors, the NORM_FORWARD operation with peer
stat tensors, ``get_heuristics_list<2>({"heuristics_instant", "heuristics_fallback"})``, the ``plan_builder`` lambda
over the filtered engine configs, the per-call ``at::empty`` workspace, ``cudnnBackendExecute``, then
``cudaMemsetAsync(peer_devPtrs[rank_id], 0, peer_size*4, stream)``) and the line numbers of the split functions at the
fix; ``apex/contrib/cudnn_gbn/batch_norm.py`` at the parent (``_GroupBatchNorm2d``, ``GroupBatchNorm2d``,
``get_peer_buffers``).
Symptom: a training step that uses ``GroupBatchNorm2d`` cannot be captured into a CUDA graph with cuDNN's runtime-
compiled (RTC) norm engines (CUDA 12.2): the capture fails in the group batch norm forward.
Mechanism: ``gbn_forward`` (and ``gbn_backward``) called ``run_batch_norm_forward`` on every step, which describes the
operation graph, queries the heuristics and builds an ``ExecutionPlan`` before executing it. Building the plan
finalizes the engine; for an RTC engine that compiles the kernel and loads the module, which waits for the device. In
eager steps this is only host overhead; inside a stream capture the wait is refused and the capture is invalidated.
Doctor: sync-in-capture, at run_batch_norm_forward. It finalizes a cuDNN plan (a device-synchronising module load)
on every call, so the first call inside the capture synchronises the capturing stream's device.
Fix (upstream): ``gbn_forward`` / ``gbn_backward`` look the plan up in ``gbn_plan_cache`` and build it only on a miss
(``run_batch_norm_forward`` / ``_backward`` now only build and return the plan); the new ``execute_batch_norm_forward``
/ ``_backward`` only allocate the workspace, execute and reset the local peer buffer. The eager warmup step builds
both plans, so the captured step only records the execution.
Modelled: ``gbn_forward`` / ``gbn_backward`` and the plan cache as read; ``run_batch_norm_forward`` / ``_backward``
(one function whose tail differs per variant, as the diff changes it: before, build then execute; after, build and
return the plan; the bug's pointer arguments are passed as one tuple), ``execute_batch_norm_forward`` / ``_backward``
(the parent's execution tail, which the fix moved there unchanged), ``_GroupBatchNorm2d`` and ``GroupBatchNorm2d``
(the fp16 check is a float64 check here; the eval fallback is left out). Stand-ins: cudnn_frontend
(``OperationGraph``, ``get_heuristics_list``, ``ExecutionPlanBuilder``) as host objects; finalizing an RTC plan is
``synchronize`` (the module load's device wait); the cuDNN norm kernels are torch ops that exchange per-rank partial
sums through the peer buffers (mean/var forward, dscale/dbias backward) -- the peer flags and the low-latency double
buffering are left out; ``peer_memory_cuda`` and the IPC exchange become one zeroed buffer per group rank with a
process group of one rank (group_size 1); float64 instead of fp16. The training step: group BN -> ReLU -> per-channel
head -> MSE, ``loss.backward()`` and an in-graph SGD update, grads set to None before the capture.
Workload: 6 training steps on (4, 8, 3, 3) channels-last batches, steps 0-1 eager, step 2 captured (grads set to None)
and steps 2-5 replayed with new data copied into the static batch. The bug raises CaptureError at the capture (the
plan finalize's synchronize in the forward's ``run_batch_norm_forward``); the fix captures and equals eager on every
step's loss, the final weights and the running statistics (max error 0). Measured on the CPU and on an H100
(torch 2.11, CUDA: the bug raises CaptureError at the forward's ``torch.cuda.synchronize()``; the fix equals eager,
max error 0), twice each.
"""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from workbench.engine import events, synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/apex/pull/1685"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "run_batch_norm_forward"
SYMPTOM = ("graph-capturing a training step with apex GroupBatchNorm2d fails: every call builds (finalizes) the "
           "runtime-compiled cuDNN norm plan, which synchronises inside the capture")

N, C, H, W = 4, 8, 3, 3
GROUP_SIZE = 1
ITERS, CAPTURE_ITERATION = 6, 2
LR, MOMENTUM, EPS = 0.1, 0.1, 1e-5
DTYPE = torch.float64
CUDNN_DATA_HALF = 2                          # cudnnDataType_t (the cache key names the data type)
BN_FWD, BN_BWD = 0, 1                        # enum bn_type

_variant = "bug"
_device = "cpu"


# --- cudnn_frontend (host-side stand-ins) ------------------------------------------------------------------------------

class cudnnException(RuntimeError):
    pass


class OperationGraph:
    def __init__(self, handle, op: str, tensorDims, peerDims, data_type):
        self.handle, self.op, self.tensorDims, self.peerDims, self.data_type = handle, op, tensorDims, peerDims, data_type

    def getTag(self) -> str:
        return f"{self.op}_{'x'.join(map(str, self.tensorDims))}_peers{self.peerDims[0]}_dt{self.data_type}"


class EngineConfig:
    def __init__(self, name: str, runtime_compiled: bool, workspace_size: int):
        self.name, self.runtime_compiled, self.workspace_size = name, runtime_compiled, workspace_size


def get_heuristics_list(modes, opGraph):
    """heuristics_instant, then heuristics_fallback: the engine configs that support the norm graph. With CUDA 12.2
    the norm engines are runtime compiled (RTC)."""
    return [EngineConfig(f"{opGraph.op}_rtc_engine", runtime_compiled=True, workspace_size=2 * opGraph.tensorDims[1])]


class ExecutionPlan:
    def __init__(self, op: str, tag: str, workspace_size: int):
        self.op, self.tag, self.workspace_size = op, tag, workspace_size

    def getWorkspaceSize(self) -> int:
        return self.workspace_size


class ExecutionPlanBuilder:
    def __init__(self, handle, engine_config, tag):
        self.handle, self.engine_config, self.tag = handle, engine_config, tag

    def build(self) -> ExecutionPlan:
        """``cudnnBackendFinalize`` of the plan. For a runtime-compiled engine it compiles the kernel (NVRTC) and
        loads the module, which waits for the device: a capturing stream refuses that wait."""
        if self.engine_config.runtime_compiled:
            synchronize(_device)
        return ExecutionPlan(self.tag.split("_")[0], self.tag, self.engine_config.workspace_size)


def getCudnnHandle():
    return "cudnnHandle"


# --- the cuDNN norm kernels (stand-ins: torch ops exchanging partial sums through the peer buffers) --------------------

def _exchange(local: torch.Tensor, peer_devPtrs, rank_id: int, first_row: int) -> torch.Tensor:
    """Write this rank's per-channel partials into every peer's buffer, then sum the group's from the local one."""
    bn_group = len(peer_devPtrs)
    for peer in peer_devPtrs:
        peer.view(bn_group, 4, -1)[rank_id, first_row:first_row + local.shape[0]].copy_(local)
    return peer_devPtrs[rank_id].view(bn_group, 4, -1)[:, first_row:first_row + local.shape[0]].sum(0)


def norm_forward_kernel(workspace, x, y, scale, bias, in_mean, in_var, out_mean, out_var, saved_mean,
                        saved_inv_var, peer_devPtrs, epsilon, exp_decay, rank_id):
    part = workspace[:2 * x.shape[1]].view(2, -1)
    part[0].copy_(x.sum((0, 2, 3)))
    part[1].copy_((x * x).sum((0, 2, 3)))
    stats = _exchange(part, peer_devPtrs, rank_id, 0)
    m = x.shape[0] * x.shape[2] * x.shape[3] * len(peer_devPtrs)
    mean = stats[0] / m
    var = stats[1] / m - mean * mean
    inv_var = (var + epsilon).rsqrt()
    saved_mean.copy_(mean)
    saved_inv_var.copy_(inv_var)
    y.copy_((x - mean[None, :, None, None]) * (inv_var * scale)[None, :, None, None] + bias[None, :, None, None])
    out_mean.copy_(in_mean * (1.0 - exp_decay) + exp_decay * mean)
    out_var.copy_(in_var * (1.0 - exp_decay) + exp_decay * var * m / (m - 1))


def norm_backward_kernel(workspace, x, dy, scale, saved_mean, saved_inv_var, dx, dscale, dbias, peer_devPtrs, rank_id):
    xhat = (x - saved_mean[None, :, None, None]) * saved_inv_var[None, :, None, None]
    part = workspace[:2 * x.shape[1]].view(2, -1)
    part[0].copy_(dy.sum((0, 2, 3)))
    part[1].copy_((dy * xhat).sum((0, 2, 3)))
    sums = _exchange(part, peer_devPtrs, rank_id, 2)
    m = x.shape[0] * x.shape[2] * x.shape[3] * len(peer_devPtrs)
    dbias.copy_(sums[0])
    dscale.copy_(sums[1])
    k = (scale * saved_inv_var / m)[None, :, None, None]
    dx.copy_(k * (m * dy - sums[0][None, :, None, None] - xhat * sums[1][None, :, None, None]))


def cudnnBackendExecute(handle, plan: ExecutionPlan, workspace, data_ptrs):
    if plan.op == "NORMFWD":
        norm_forward_kernel(workspace, *data_ptrs)
    else:
        norm_backward_kernel(workspace, *data_ptrs)


# --- apex/contrib/csrc/cudnn_gbn/norm_sample.cpp --------------------------------------------------------------------------

def _build_plan(op, tensorDims, peerDims, data_type):
    handle_ = getCudnnHandle()
    opGraph = OperationGraph(handle_, op, tensorDims, peerDims, data_type)
    filtered_configs = get_heuristics_list(["heuristics_instant", "heuristics_fallback"], opGraph)

    def plan_builder():
        for cfg in filtered_configs:
            try:
                return ExecutionPlanBuilder(handle_, cfg, opGraph.getTag()).build()
            except cudnnException:
                continue
        return ExecutionPlanBuilder(handle_, filtered_configs[0], opGraph.getTag()).build()

    assert len(filtered_configs) > 0
    return plan_builder()


def run_batch_norm_forward(tensorDims, perChannelSum, epsilon, peerDims, data_type, execute_args=None):
    """Describe the NORM_FORWARD (training) op with its peer stat tensors and build the plan. Before #1685 it then
    executes the plan (every call); after, it returns the plan for ``gbn_plan_cache``."""
    plan = _build_plan("NORMFWD", tensorDims, peerDims, data_type)
    if _variant == "fix":
        return plan
    execute_batch_norm_forward(plan, *execute_args)


def execute_batch_norm_forward(plan, xDevPtr, yDevPtr, scaledevPtr, biasdevPtr, in_meandevPtr, in_vardevPtr,
                               out_meandevPtr, out_vardevPtr, saved_meandevPtr, saved_inv_vardevPtr, peer_devPtrs,
                               epsilon_val, exponential_decay_factor, peer_size, rank_id):
    handle_ = getCudnnHandle()
    workspace_size = plan.getWorkspaceSize()
    workspace_tensor = torch.empty((workspace_size,), dtype=DTYPE, device=_device)
    data_ptrs = [xDevPtr, yDevPtr, scaledevPtr, biasdevPtr, in_meandevPtr, in_vardevPtr, out_meandevPtr,
                 out_vardevPtr, saved_meandevPtr, saved_inv_vardevPtr, peer_devPtrs, epsilon_val,
                 exponential_decay_factor, rank_id]
    cudnnBackendExecute(handle_, plan, workspace_tensor, data_ptrs)
    # Reset local communication buffer
    peer_devPtrs[rank_id][:peer_size].zero_()                     # cudaMemsetAsync(peer_devPtrs[rank_id], 0, ...)


def run_batch_norm_backward(tensorDims, perChannelSum, epsilon, peerDims, data_type, execute_args=None):
    plan = _build_plan("NORMBWD", tensorDims, peerDims, data_type)
    if _variant == "fix":
        return plan
    execute_batch_norm_backward(plan, *execute_args)


def execute_batch_norm_backward(plan, xDevPtr, dyDevPtr, scaledevPtr, saved_meandevPtr, saved_inv_vardevPtr,
                                dxDevPtr, dscaledevPtr, dbiasdevPtr, peer_devPtrs, epsilon_val, peer_size, rank_id):
    handle_ = getCudnnHandle()
    workspace_tensor = torch.empty((plan.getWorkspaceSize(),), dtype=DTYPE, device=_device)
    data_ptrs = [xDevPtr, dyDevPtr, scaledevPtr, saved_meandevPtr, saved_inv_vardevPtr, dxDevPtr, dscaledevPtr,
                 dbiasdevPtr, peer_devPtrs, rank_id]
    cudnnBackendExecute(handle_, plan, workspace_tensor, data_ptrs)
    peer_devPtrs[rank_id][:peer_size].zero_()


# --- apex/contrib/csrc/cudnn_gbn/cudnn_gbn.cpp ------------------------------------------------------------------------------

gbn_plan_cache: dict = {}                      # static std::map<std::vector<int64_t>, ExecutionPlan> (the fix)


def gbn_forward(x, scale, bias, running_mean, running_var, minibatch_mean, minibatch_inv_var, momentum, epsilon,
                bn_group, rank_id, peer_buffers):
    N_, C_, H_, W_ = x.shape
    tensorDims, peerDims, perChannelDims, epsilonDims = [N_, C_, H_, W_], [bn_group, 4 * C_, 1, 1], [1, C_, 1, 1], [1] * 4
    y = torch.empty_like(x)
    void_peer_buffers = list(peer_buffers)
    peer_size = bn_group * 4 * C_
    assert bn_group == len(void_peer_buffers)
    args = (x, y, scale, bias, running_mean, running_var, running_mean, running_var, minibatch_mean,
            minibatch_inv_var, void_peer_buffers, float(epsilon), float(momentum), peer_size, rank_id)
    if _variant == "bug":
        run_batch_norm_forward(tensorDims, perChannelDims, epsilonDims, peerDims, CUDNN_DATA_HALF, args)
        return y
    # check if plan already exists
    fv = (BN_FWD, N_, C_, H_, W_, bn_group, CUDNN_DATA_HALF)
    if fv not in gbn_plan_cache:
        gbn_plan_cache[fv] = run_batch_norm_forward(tensorDims, perChannelDims, epsilonDims, peerDims, CUDNN_DATA_HALF)
    plan = gbn_plan_cache[fv]
    execute_batch_norm_forward(plan, *args)
    return y


def gbn_backward(x, dy, scale, minibatch_mean, minibatch_inv_var, epsilon, bn_group, rank_id, peer_buffers):
    N_, C_, H_, W_ = x.shape
    tensorDims, peerDims, perChannelDims, epsilonDims = [N_, C_, H_, W_], [bn_group, 4 * C_, 1, 1], [1, C_, 1, 1], [1] * 4
    x_grad, scale_grad, bias_grad = torch.empty_like(x), torch.empty_like(scale), torch.empty_like(scale)
    void_peer_buffers = list(peer_buffers)
    peer_size = bn_group * 4 * C_
    assert bn_group == len(void_peer_buffers)
    args = (x, dy, scale, minibatch_mean, minibatch_inv_var, x_grad, scale_grad, bias_grad, void_peer_buffers,
            float(epsilon), peer_size, rank_id)
    if _variant == "bug":
        run_batch_norm_backward(tensorDims, perChannelDims, epsilonDims, peerDims, CUDNN_DATA_HALF, args)
        return [x_grad, scale_grad, bias_grad]
    fv = (BN_BWD, N_, C_, H_, W_, bn_group, CUDNN_DATA_HALF)
    if fv not in gbn_plan_cache:
        gbn_plan_cache[fv] = run_batch_norm_backward(tensorDims, perChannelDims, epsilonDims, peerDims, CUDNN_DATA_HALF)
    plan = gbn_plan_cache[fv]
    execute_batch_norm_backward(plan, *args)
    return [x_grad, scale_grad, bias_grad]


class cudnn_gbn_lib:
    forward = staticmethod(gbn_forward)
    backward = staticmethod(gbn_backward)


# --- peer_memory_cuda / torch.distributed (one process, group of one rank) -------------------------------------------------

class pm:
    @staticmethod
    def allocate_raw(nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes // 4, dtype=DTYPE, device=_device)

    @staticmethod
    def get_raw_peers(peer_raw_ipcs, group_rank, raw):
        return [raw]                               # the group's buffers, mapped through IPC (here: this rank's)


# --- apex/contrib/cudnn_gbn/batch_norm.py -----------------------------------------------------------------------------------

class _GroupBatchNorm2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_variance, minibatch_mean, minibatch_inv_var,
                momentum, eps, group_size, group_rank, fwd_buffers, bwd_buffers):
        ctx.save_for_backward(input, weight, minibatch_mean, minibatch_inv_var)
        ctx.eps = eps
        ctx.bn_group = group_size
        ctx.rank_id = group_rank
        ctx.peer_buffers = bwd_buffers
        return cudnn_gbn_lib.forward(input, weight, bias, running_mean, running_variance, minibatch_mean,
                                     minibatch_inv_var, momentum, eps, group_size, group_rank, fwd_buffers)

    @staticmethod
    def backward(ctx, grad_output):
        x, scale, minibatch_mean, minibatch_inv_var = ctx.saved_tensors
        dx, dscale, dbias = cudnn_gbn_lib.backward(x, grad_output, scale, minibatch_mean, minibatch_inv_var,
                                                   ctx.eps, ctx.bn_group, ctx.rank_id, ctx.peer_buffers)
        return dx, dscale, dbias, None, None, None, None, None, None, None, None, None, None


class GroupBatchNorm2d(_BatchNorm):
    def __init__(self, num_features, group_size, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, device=_device, dtype=DTYPE)
        self.group_size = group_size
        rank = 0                                                   # torch.distributed.get_rank()
        self.group_id = rank // group_size
        self.group_rank = rank % group_size
        self.fwd_peer_buffers = self.get_peer_buffers(num_features)
        self.bwd_peer_buffers = self.get_peer_buffers(num_features)
        self.minibatch_mean = torch.empty(num_features, dtype=DTYPE, device=_device)
        self.minibatch_inv_var = torch.empty(num_features, dtype=DTYPE, device=_device)

    def get_peer_buffers(self, num_features):
        # group_size * 2 (low-latency algo) * 2 (mean+var) * channels * 4 (float32)
        peer_size = self.group_size * 4 * num_features * 4
        raw = pm.allocate_raw(peer_size)
        return pm.get_raw_peers(None, self.group_rank, raw)

    def forward(self, input):
        if not input.is_contiguous(memory_format=torch.channels_last):
            raise ValueError("GroupBatchNorm2d expected input tensor to be in channels last memory format")
        if input.dtype != DTYPE:
            raise ValueError("GroupBatchNorm2d expected input tensor in float16 (float64 here)")
        if input.dim() != 4 or input.size(1) % 8 != 0:
            raise ValueError("GroupBatchNorm2d expects 4D input with a multiple of 8 channels")
        return _GroupBatchNorm2d.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                       self.minibatch_mean, self.minibatch_inv_var, self.momentum, self.eps,
                                       self.group_size, self.group_rank, self.fwd_peer_buffers, self.bwd_peer_buffers)


# --- the training step (the user's graph-captured iteration) ----------------------------------------------------------------

class Model:
    def __init__(self):
        gen = generator(1685)
        self.bn = GroupBatchNorm2d(C, GROUP_SIZE, eps=EPS, momentum=MOMENTUM)
        with torch.no_grad():
            self.bn.weight.copy_(1.0 + randn(C, gen=gen, device=_device, scale=0.2).to(DTYPE))
            self.bn.bias.copy_(randn(C, gen=gen, device=_device, scale=0.2).to(DTYPE))
        self.w_head = randn(C, gen=gen, device=_device, scale=0.5).to(DTYPE).requires_grad_()

    def parameters(self):
        return [self.bn.weight, self.bn.bias, self.w_head]

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def train_step(self, x, target):
        y = self.bn(x)
        pred = (torch.relu(y) * self.w_head[None, :, None, None]).sum(1)
        loss = ((pred - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in self.parameters():
                p.sub_(LR * p.grad)
        return loss.detach()

    def final_state(self):
        return [p.detach() for p in self.parameters()] + [self.bn.running_mean, self.bn.running_var]


def run(variant: str, device: str = "cpu"):
    global _variant, _device
    _variant, _device = variant, device
    gbn_plan_cache.clear()                        # a fresh process
    gen = generator(16850)
    xs = [randn(N, C, H, W, gen=gen, device=device).to(DTYPE).contiguous(memory_format=torch.channels_last)
          for _ in range(ITERS)]
    targets = [randn(N, H, W, gen=gen, device=device).to(DTYPE) for _ in range(ITERS)]

    def eager():
        model = Model()
        losses = []
        for x, t in zip(xs, targets):
            model.zero_grad()
            losses.append(model.train_step(x, t))
        return [torch.stack(losses)] + model.final_state()

    def served():
        model = Model()
        static_x = torch.empty_like(xs[0])
        static_target = torch.empty_like(targets[0])
        losses, g, out = [], None, None
        for it in range(ITERS):
            static_x.copy_(xs[it])
            static_target.copy_(targets[it])
            if it < CAPTURE_ITERATION:
                with events.warmup():
                    model.zero_grad()
                    losses.append(model.train_step(static_x, static_target))
                continue
            if it == CAPTURE_ITERATION:
                model.zero_grad()                  # grads allocated by the capture: static from then on
                state = {"bn.weight": model.bn.weight, "bn.bias": model.bn.bias, "w_head": model.w_head,
                         "bn.running_mean": model.bn.running_mean, "bn.running_var": model.bn.running_var}
                g, out = capture(lambda: model.train_step(static_x, static_target), device=device, warmups=0,
                                 name="sgbn training step", owner="training loop",
                                 static={"x": static_x, "target": static_target}, state=state)
            losses.append(replay(g, out, size=1).clone())
        return [torch.stack(losses)] + model.final_state()

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
