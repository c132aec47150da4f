"""Two HIP graph kernel nodes of one kernel share its Level Zero handle: both launch with the last node's arguments.

Upstream: https://github.com/CHIP-SPV/chipStar/pull/1356 (commit 283b31118371, "[L0] Give each graph kernel node a
private kernel handle (#782)"), fixing https://github.com/CHIP-SPV/chipStar/issues/782.
Symptom: a graph with two kernel nodes of ``k(int Val)``, args 123 and 321, prints "Val=321" twice on Level Zero
(OpenCL prints 123 and 321); eager ``hipLaunchKernel`` is right.
Mechanism: ``CHIPGraphNodeKernel::CHIPGraphNodeKernel(const hipKernelNodeParams*)`` finds the kernel with
``Dev->findKernel(func)`` (one ``CHIPKernelLevel0`` per function, wrapping ONE ``ze_kernel_handle_t`` that every
user shares), builds ``ExecItem_`` (``Backend->createExecItem``), ``setKernel(ChipKernel)``, ``setArgs(params)`` and
already calls ``setupAllArgs()`` at node construction: ``zeKernelSetArgumentValue`` binds the node's arguments onto
the handle and sets ``ArgsSetup = true``. Node 1's construction binds its arguments onto the same handle, over
node 0's. At ``hipGraphLaunch`` (``CHIPGraphExec::launch`` -> ``CHIPGraphNodeKernel::execute`` ->
``Queue->launch(ExecItem_)``) ``setupAllArgs()`` returns early (``ArgsSetup``), so no node re-binds: every launch
reads the handle's current arguments, node 1's. Here the kernel is ``k(int Slot, float Val)`` writing
``Out[Slot] = In * Val`` (``In``/``Out`` are module ``__device__`` globals, refreshed with ``hipMemcpyToSymbol``
before every launch); the handle's argument state is a small device tensor that ``zeKernelSetArgumentValue``
writes and the kernel reads when it runs. The instantiated graph is captured once and replayed per
``hipGraphLaunch``: both nodes write ``Out[1]`` with node 1's ``Val``, ``Out[0]`` keeps what was there before.
Doctor: stale-input, at ``setupAllArgs`` (it binds each node's arguments onto the shared per-function handle once,
at node construction; launches skip the re-bind, so node 0 reads what node 1's binding left in that input).
Fix (upstream): a hook ``ExecItem::useIndependentKernelHandle()`` (no-op by default; OpenCL already borrows a unique
``cl_kernel``), called in both ``CHIPGraphNodeKernel`` constructors after ``setKernel()``; the Level Zero override
``takeOwnedKernelClone()`` does ``ChipKernel_ = ChipKernel_->clone(); OwnsKernel_ = true`` where
``CHIPKernelLevel0::clone()`` makes a fresh handle with ``zeKernelCreate(Module->get(), ...)``; ``clone()`` of an
exec item (``hipGraphClone``) also takes an owned clone and resets ``ArgsSetup``. (Diff read:
``src/CHIPGraph.cc``, ``src/backend/Level0/CHIPBackendLevel0.{cc,hh}``, ``src/CHIPBackend.hh``.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/CHIP-SPV/chipStar/pull/1356"
FAMILY = "persistent-buffer mutation"
KIND = "stale-input"
SITE = "setupAllArgs"
SYMPTOM = "both graph kernel nodes of one kernel run with the last node's arguments (Val=321 printed twice)"

N, SLOTS, STEPS = 4, 2, 4
NODE_ARGS = ((0, 1.23), (1, -3.21))         # (Slot, Val) of node 0 and node 1: k<<<1, N>>>(Slot, Val)


def k(args: torch.Tensor, In: torch.Tensor, Out: torch.Tensor):
    """``__global__ void k(int Slot, float Val) { Out[Slot][tid] = In[tid] * Val; }``: reads its arguments from the
    kernel handle when it runs."""
    slot = args[0:1].to(torch.long)
    Out.index_copy_(0, slot, (In * args[1])[None, :])


class CHIPModuleLevel0:
    """The module: the ``__device__`` globals and the kernel functions (one ``CHIPKernelLevel0`` each)."""

    def __init__(self, device: str):
        self.device = device
        self.In = torch.zeros(N, device=device)
        self.Out = torch.zeros(SLOTS, N, device=device)
        self.kernels = {k: CHIPKernelLevel0(k, self)}

    def get(self):
        return self


class CHIPKernelLevel0:
    """Wraps one ``ze_kernel_handle_t``: its argument bindings (``ze_args``) are state of the handle."""

    def __init__(self, func, module: CHIPModuleLevel0):
        self.func, self.Module = func, module
        self.ze_args = torch.zeros(2, device=module.device)   # zeKernelCreate: the handle's argument slots

    def clone(self) -> "CHIPKernelLevel0":
        """#1356: a fresh handle from the parent module (Level Zero has no zeKernelClone)."""
        return CHIPKernelLevel0(self.func, self.Module.get())


def zeKernelSetArgumentValue(kernel: CHIPKernelLevel0, index: int, value: float):
    kernel.ze_args[index].fill_(value)


class CHIPExecItemLevel0:
    def __init__(self, variant: str):
        self.variant = variant
        self.ChipKernel_, self.Args, self.ArgsSetup, self.OwnsKernel_ = None, (), False, False

    def setKernel(self, kernel: CHIPKernelLevel0):
        self.ChipKernel_ = kernel

    def setArgs(self, kernel_params):
        self.Args = tuple(kernel_params)

    def useIndependentKernelHandle(self):
        """The #1356 hook; before it, a Level Zero exec item kept the shared handle (the default no-op)."""
        if self.variant == "fix":
            self.takeOwnedKernelClone()

    def takeOwnedKernelClone(self):
        self.ChipKernel_ = self.ChipKernel_.clone()
        self.OwnsKernel_ = True

    def setupAllArgs(self):
        """Bind the arguments onto the kernel's handle, once (``ArgsSetup``)."""
        if self.ArgsSetup:
            return
        self.ArgsSetup = True
        for index, value in enumerate(self.Args):
            zeKernelSetArgumentValue(self.ChipKernel_, index, float(value))


class Queue:
    def launch(self, exec_item: CHIPExecItemLevel0):
        exec_item.setupAllArgs()                  # no-op for a graph node: bound at construction
        kernel = exec_item.ChipKernel_            # zeCommandListAppendLaunchKernel(handle, ...)
        kernel.func(kernel.ze_args, kernel.Module.In, kernel.Module.Out)


class CHIPGraphNodeKernel:
    def __init__(self, module: CHIPModuleLevel0, func, kernel_params, variant: str):
        ChipKernel = module.kernels[func]         # Dev->findKernel(HostPtr(Params_.func)): shared per function
        self.ExecItem_ = CHIPExecItemLevel0(variant)   # Backend->createExecItem(gridDim, blockDim, ...)
        self.ExecItem_.setKernel(ChipKernel)
        self.ExecItem_.useIndependentKernelHandle()
        self.ExecItem_.setArgs(kernel_params)
        self.ExecItem_.setupAllArgs()             # graph-node construction binds before any launch

    def execute(self, queue: Queue):
        queue.launch(self.ExecItem_)


class CHIPGraphExec:
    """``hipGraphInstantiate``: the node walk is captured once; ``hipGraphLaunch`` replays it."""

    def __init__(self, nodes, module: CHIPModuleLevel0, queue: Queue):
        self.nodes, self.module, self.queue = nodes, module, queue
        static = {"In (__device__ global)": module.In}
        for i, node in enumerate(nodes):
            static[f"node {i} ze_kernel_handle args"] = node.ExecItem_.ChipKernel_.ze_args
        self.graph, self.out = capture(self.launch, device=module.device, warmups=0, name="hipGraphExec",
                                       owner="chipStar CHIPGraphExec (Level Zero)", static=static)

    def launch(self):
        for node in self.nodes:                   # ExecQueues_: one level per node (a chain)
            node.execute(self.queue)
        return self.module.Out

    def hipGraphLaunch(self):
        return replay(self.graph, self.out)


def hipLaunchKernel(module: CHIPModuleLevel0, queue: Queue, func, kernel_params, variant: str):
    """The eager path: a fresh exec item per launch, arguments bound right before the kernel is appended."""
    item = CHIPExecItemLevel0(variant)
    item.setKernel(module.kernels[func])
    item.setArgs(kernel_params)
    queue.launch(item)


def run(variant: str, device: str = "cpu"):
    gen = generator(782)
    inputs = [randn(N, gen=gen, device=device) for _ in range(STEPS)]

    def serve(graphed: bool):
        module, queue = CHIPModuleLevel0(device), Queue()
        if graphed:                               # hipGraphCreate + hipGraphAddKernelNode x2 + hipGraphInstantiate
            nodes = [CHIPGraphNodeKernel(module, k, params, variant) for params in NODE_ARGS]
            graph_exec = CHIPGraphExec(nodes, module, queue)
        outs = []
        for x in inputs:
            module.In.copy_(x)                    # hipMemcpyToSymbol(In, ...)
            if graphed:
                out = graph_exec.hipGraphLaunch()
            else:
                for params in NODE_ARGS:
                    hipLaunchKernel(module, queue, k, params, variant)
                out = module.Out
            outs.append(out.clone())              # hipMemcpyFromSymbol(Out, ...)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
