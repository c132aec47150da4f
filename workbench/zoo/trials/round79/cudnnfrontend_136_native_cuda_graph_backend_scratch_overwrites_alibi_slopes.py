"""cuDNN frontend's native CUDA graph gives the backend plan the un-offset workspace, so the plan's scratch overwrites the FE-owned ALiBi slopes on every launch.

Upstream: https://github.com/NVIDIA/cudnn-frontend/pull/136 ("# v1.11.0 release", merged 2025-03-20, commit 8801fd7;
release note: "Fixed a bug when using the update_cuda_graph API to update cuda graph for sdpa bprop operation").
Sibling: https://github.com/NVIDIA/cudnn-frontend/pull/123 ("# cudnn frontend v1.9 release notes", 2024-12-20,
"Fixed natively creating cuda graphs for SDPA with alibi masks"). That PR bound the ALiBi slopes' workspace address in
the variant pack but left the backend's workspace pointer as it was. The graph path itself came in #118 (v1.8).
Symptom: an SDPA forward with ``alibi_mask`` that is built as a native CUDA graph (``populate_cuda_graph``, then
``cudaGraphInstantiate`` / ``cudaGraphLaunch``) gives outputs that differ from ``graph->execute()`` on the same
buffers, on every launch. Nothing is raised.
Mechanism: the frontend (FE) keeps tensors of its own at the start of the user workspace, in
``[0, fe_workspace_size)``. ``SDPANode::collect_tensors_in_workspace_node`` puts the ALiBi slopes there: a type-0
(memcpy) entry at offset 0, filled with ``detail::get_abili_slope(h_q)``, padded to 16 bytes. ``Graph::build``
records ``fe_workspace_size``. ``get_workspace_size`` returns the backend plan's workspace plus
``fe_workspace_size``. The eager ``Graph::execute`` (include/cudnn_frontend/graph_interface.h) calls
``run_auxiliary_kernels``, which copies the slopes to ``workspace + offset``. It then calls
``extend_tensor_map_with_workspace_tensors_`` and runs the plan with ``cudnn_workspace = workspace +
fe_workspace_size``, so the backend's scratch begins after the FE's tensors. ``Graph::populate_cuda_graph`` rebuilds
this bookkeeping by hand. It adds a memcpy node for the slopes, which #123 binds in ``uid_to_device_ptrs``. But it
then calls ``create_variant_pack(variant_pack_descriptor, device_ptrs, uids, workspace)`` with the *un-offset*
workspace and has the backend populate its child graph from that variant pack. ``update_cuda_graph`` makes the same
call. The backend plan owns the first bytes of the workspace it is given, so its scratch lies over the slopes. On
every launch the memcpy node writes the slopes, the plan's first kernel writes its scratch (here: the softmax row
maxima) over them, and the plan's next kernel reads the ALiBi slopes from that address. (For SDPA backward the same
un-offset pointer overlaps the ``dQ_accum`` / ``softmax_sum`` / ``dK_fullhead`` / ``dV_fullhead`` workspace tensors.
There, pre-fix, the missing device pointers of the type-1/type-2 entries fail first with "Uid ... does not exist in
variant pack". That is the #136 release note's bprop case, and it is not modelled.)
Doctor: warmup-divergence, at populate_cuda_graph. Building the graph decided the backend plan's workspace address
(the un-offset ``workspace``). That address is baked into the backend's child-graph nodes, and every launch reuses
it. The eager step, ``Graph::execute``, places the same plan's scratch at ``workspace + fe_workspace_size``. So the
graph's kernels read the slopes at a place that the graph's own scratch has overwritten, while eager reads them
intact. The fix changed code in ``populate_cuda_graph`` (and in ``update_cuda_graph``).
Fix (upstream): ``populate_cuda_graph`` and ``update_cuda_graph`` pass ``void *cudnn_workspace = static_cast<char
*>(workspace) + fe_workspace_size`` to ``create_variant_pack``. They also set ``uid_to_device_ptrs[uid] = workspace
+ offset`` for every workspace tensor, not only memcpy ones. And they ``continue`` past type-2 entries, so that the
update walk along the memcpy/memset node chain does not advance for them.
Modelled: one SDPA forward node, ``alibi_mask=True`` and no other mask, with b=1, h=4, s_q=4, s_kv=8, d=8 in float32.
The graph is built after #123, so the slopes' uid is bound. The backend's engine is opaque upstream. Here it is a
two-pass softmax attention plan whose scratch is the per-row max and sum (``get_workspace_size`` = 128 bytes). Pass 1
recomputes the ALiBi-biased scores and writes the row maxima at the start of its workspace. Pass 2 recomputes the
scores, reading the slopes again, and writes the output. A real engine's scratch layout and kernel order are its
own; the contract modelled is that the plan owns ``[ptr, ptr + plan workspace)`` of the pointer it is given. The
native graph, which upstream is built node by node, is modelled as the kit's capture of the equivalent ops in node
order. Those ops are the FE memcpy node (a non-blocking copy from pinned host memory), then the backend's child graph
with the pointers bound at populate time. ``cudaGraphInstantiate`` is the capture (no warmup, as nothing runs at
populate), and ``cudaGraphLaunch`` is a replay. The memcpy node's host source is kept alive with the graph. Upstream
it is the ``std::vector`` of a map local to ``populate_cuda_graph``, a lifetime question this program leaves out.
The workload follows the sample ``fp16_fwd_with_cudagraphs.cpp``: populate once, then for each of 3 steps write new
Q/K/V into the bound buffers and launch. The reference is ``execute()`` on the same buffers. ``update_cuda_graph``,
pass-by-value tensors, the handle's stream, padding masks and bprop are left out.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/cudnn-frontend/pull/136"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "populate_cuda_graph"
SYMPTOM = ("SDPA with an ALiBi mask built as a native cuDNN CUDA graph: the backend plan gets the un-offset workspace, "
           "its scratch overwrites the FE-owned ALiBi slopes on every launch, and outputs differ from execute()")

B, H_Q, S_Q, S_KV, D = 1, 4, 4, 8, 8
Q_UID, K_UID, V_UID, O_UID = 1, 2, 3, 4
STEPS = 3
FLOAT = 4                               # sizeof(float)


def f32(ptr: torch.Tensor, n: int) -> torch.Tensor:
    """``static_cast<float *>(ptr)`` for ``n`` floats: a float view of the byte address ``ptr``."""
    return ptr[:n * FLOAT].view(torch.float32)


# --- include/cudnn_frontend_utils.h ------------------------------------------------------------------------

def get_abili_slope(n_heads: int) -> list[float]:
    n = 1 << int(math.log2(n_heads))
    slope = [float(i + 1.0) for i in range(n)]
    slope += [(i + 1) * 0.5 for i in range(0, 2 * (n_heads - n), 2)]
    return [2.0 ** (elem * -8.0 / n) for elem in slope]


# --- include/cudnn_frontend/node/scaled_dot_product_flash_attention.h (SDPANode) ---------------------------

class SDPANode:
    def __init__(self, attn_scale: float, alibi_mask: bool):
        self.attn_scale, self.alibi_mask = attn_scale, alibi_mask
        self.alibi_slopes_uid = None
        self.alibi_slopes_size = 0

    def expand_node(self, next_uid: int) -> int:
        if self.alibi_mask:                       # attn::score_modifiers::alibi_mask
            self.alibi_slopes_uid = next_uid
            self.alibi_slopes_size = H_Q * FLOAT
            next_uid += 1
        return next_uid

    def get_fe_workspace_size_node(self) -> int:
        # align alibi slopes memory to 16 bytes
        return (self.alibi_slopes_size + 15) // 16 * 16

    def collect_tensors_in_workspace_node(self, workspace_modifications: dict, offset: int, device) -> int:
        if self.alibi_mask:
            alibi_slopes_vec = host(torch.tensor(get_abili_slope(H_Q), dtype=torch.float32), device)
            workspace_modifications[self.alibi_slopes_uid] = (0, offset, alibi_slopes_vec)
            offset = offset + (self.alibi_slopes_size + 15) // 16 * 16
        return offset


# --- the cuDNN backend: the engine's execution plan (opaque upstream) ---------------------------------------

def _scores(q, k, alibi_slopes, attn_scale):
    s = (q @ k.transpose(-1, -2)) * attn_scale
    row_idx = torch.arange(S_Q, device=q.device).view(S_Q, 1)          # GEN_INDEX axis 2
    col_idx = torch.arange(S_KV, device=q.device).view(1, S_KV)        # GEN_INDEX axis 3
    return s + (col_idx - row_idx) * alibi_slopes.view(1, H_Q, 1, 1)   # sub_col_row, mul_slope, add_alibi


class ExecutionPlan:
    """A two-pass softmax attention engine. Its scratch is the row max and row sum, at the start of the workspace
    pointer in its variant pack."""

    def __init__(self, node: SDPANode):
        self.node = node
        self.rows = B * H_Q * S_Q

    def get_workspace_size(self) -> int:
        return 2 * self.rows * FLOAT

    def kernels(self, ptrs: dict, workspace: torch.Tensor):
        """The plan's kernels with their arguments bound (what ``cudnnBackendExecute`` launches and what
        ``cudnnBackendPopulateCudaGraph`` puts in the child graph)."""
        q, k, v, o = ptrs[Q_UID], ptrs[K_UID], ptrs[V_UID], ptrs[O_UID]
        alibi_slopes = f32(ptrs[self.node.alibi_slopes_uid], H_Q)
        row_max = f32(workspace, self.rows).view(B, H_Q, S_Q, 1)
        row_sum = f32(workspace[self.rows * FLOAT:], self.rows).view(B, H_Q, S_Q, 1)
        scale = self.node.attn_scale

        def max_pass():
            row_max.copy_(_scores(q, k, alibi_slopes, scale).amax(-1, keepdim=True))

        def exp_sum_pv_pass():
            p = torch.exp(_scores(q, k, alibi_slopes, scale) - row_max)
            row_sum.copy_(p.sum(-1, keepdim=True))
            o.copy_((p @ v) / row_sum)

        return [max_pass, exp_sum_pv_pass]


def create_variant_pack(device_ptrs, uids, workspace):
    return dict(zip(uids, device_ptrs)), workspace


def backend_execute(plan: ExecutionPlan, variant_pack):
    for kernel in plan.kernels(*variant_pack):
        kernel()


def backend_populate_cuda_graph(plan: ExecutionPlan, variant_pack, backend_cuda_graph: "CudaGraph"):
    for kernel in plan.kernels(*variant_pack):
        backend_cuda_graph.nodes.append(kernel)


# --- CUDA's graph API (a graph built node by node) ----------------------------------------------------------

class CudaGraph:
    """A ``cudaGraph_t`` whose nodes form a chain (the FE builds linear graphs)."""

    def __init__(self):
        self.nodes = []

    def launch_nodes(self):
        for node in self.nodes:
            node()


def cuda_graph_add_memcpy_node_1D(graph: CudaGraph, dst: torch.Tensor, src: torch.Tensor):
    def memcpy_node():                   # cudaMemcpyHostToDevice, reading ``src`` at every launch
        dst.copy_(src, non_blocking=True)
    graph.nodes.append(memcpy_node)


def cuda_graph_add_child_graph_node(graph: CudaGraph, child: CudaGraph):
    graph.nodes.append(child.launch_nodes)


# --- include/cudnn_frontend/graph_interface.h (Graph) -------------------------------------------------------

class Graph:
    def __init__(self, variant: str, device: str):
        self.variant, self.device = variant, device
        self.sub_nodes = [SDPANode(attn_scale=D ** -0.5, alibi_mask=True)]
        self.fe_workspace_size = 0
        self.variant_pack_uids: list[int] = []
        self.plan = None

    def build(self):
        next_uid = O_UID + 1
        for node in self.sub_nodes:
            next_uid = node.expand_node(next_uid)
        self.variant_pack_uids = [Q_UID, K_UID, V_UID, O_UID] + [n.alibi_slopes_uid for n in self.sub_nodes]
        self.fe_workspace_size = sum(n.get_fe_workspace_size_node() for n in self.sub_nodes)
        self.plan = ExecutionPlan(self.sub_nodes[0])

    def get_workspace_size(self) -> int:
        return self.plan.get_workspace_size() + self.fe_workspace_size

    def collect_tensors_in_workspace_subtree(self) -> dict:
        workspace_modifications, offset = {}, 0
        for node in self.sub_nodes:
            offset = node.collect_tensors_in_workspace_node(workspace_modifications, offset, self.device)
        return workspace_modifications

    def run_auxiliary_kernels(self, workspace, workspace_modifications):
        for uid, (operation_type, offset, vec_data) in workspace_modifications.items():
            if operation_type == 0:
                f32(workspace[offset:], vec_data.numel()).copy_(vec_data, non_blocking=True)
            elif operation_type == 1:
                workspace[offset:offset + int(vec_data[0])].zero_()

    def extend_tensor_map_with_workspace_tensors_(self, tensor_to_pointer_map, workspace, workspace_modifications):
        for uid, (_, offset, _) in workspace_modifications.items():
            tensor_to_pointer_map.setdefault(uid, workspace[offset:])

    def execute(self, handle, tensor_uid_to_pointer_map: dict, workspace: torch.Tensor):
        workspace_modifications = self.collect_tensors_in_workspace_subtree()
        self.run_auxiliary_kernels(workspace, workspace_modifications)
        self.extend_tensor_map_with_workspace_tensors_(tensor_uid_to_pointer_map, workspace, workspace_modifications)
        # offset workspace by the already used fe graph workspace
        # this is where cudnn backend can start using workspace for its execution plans
        cudnn_workspace = workspace[self.fe_workspace_size:]
        uids = self.variant_pack_uids
        backend_execute(self.plan, create_variant_pack([tensor_uid_to_pointer_map[u] for u in uids], uids,
                                                       cudnn_workspace))

    def populate_cuda_graph(self, handle, uid_to_device_ptrs: dict, workspace: torch.Tensor,
                            cudnn_cuda_graph: CudaGraph):
        assert not cudnn_cuda_graph.nodes, "cuda graph provided to populate is not empty"
        workspace_modifications = self.collect_tensors_in_workspace_subtree()
        for uid, (operation_type, offset, vec_data) in workspace_modifications.items():
            if self.variant == "fix":
                uid_to_device_ptrs[uid] = workspace[offset:]
            if operation_type == 0:                                        # 0 means memcpy
                cuda_graph_add_memcpy_node_1D(cudnn_cuda_graph, f32(workspace[offset:], vec_data.numel()), vec_data)
                if self.variant == "bug":
                    uid_to_device_ptrs[uid] = workspace[offset:]           # (#123: memcpy entries only)
            elif operation_type == 1:                                      # 1 means memset
                raise NotImplementedError("no memset entries in a forward SDPA")
            else:
                continue
        device_ptrs, uids = [], []
        for uid in self.variant_pack_uids:
            if uid not in uid_to_device_ptrs:
                raise KeyError(f"Uid {uid} does not exist in variant pack.")
            device_ptrs.append(uid_to_device_ptrs[uid])
            uids.append(uid)
        if self.variant == "bug":
            variant_pack = create_variant_pack(device_ptrs, uids, workspace)
        else:
            # offset workspace by the already used fe graph workspace
            # this is where cudnn backend can start using workspace for its execution plans
            cudnn_workspace = workspace[self.fe_workspace_size:]
            variant_pack = create_variant_pack(device_ptrs, uids, cudnn_workspace)
        backend_cuda_graph = CudaGraph()
        backend_populate_cuda_graph(self.plan, variant_pack, backend_cuda_graph)
        cuda_graph_add_child_graph_node(cudnn_cuda_graph, backend_cuda_graph)


# --- samples/cpp/sdpa/fp16_fwd_with_cudagraphs.cpp ----------------------------------------------------------

class SdpaTestData:
    def __init__(self, workspace_size: int, device: str):
        self.q = torch.zeros(B, H_Q, S_Q, D, device=device)
        self.k = torch.zeros(B, H_Q, S_KV, D, device=device)
        self.v = torch.zeros(B, H_Q, S_KV, D, device=device)
        self.o = torch.zeros(B, H_Q, S_Q, D, device=device)
        self.workspace = torch.zeros(workspace_size, dtype=torch.uint8, device=device)

    def build_variant_pack(self) -> dict:
        return {Q_UID: self.q, K_UID: self.k, V_UID: self.v, O_UID: self.o}

    def get_workspace_ptr(self) -> torch.Tensor:
        return self.workspace


def cudaGraphInstantiate(cudnn_cuda_graph: CudaGraph, data: SdpaTestData, device: str):
    """The graph's nodes as one captured step (nothing runs before: populate launches nothing)."""
    def launch():
        cudnn_cuda_graph.launch_nodes()
        return data.o

    return capture(launch, device=device, warmups=0, name="cudnn_cuda_graph (sdpa fwd, alibi)",
                   owner="cudnn_cuda_graph", static={"Q": data.q, "K": data.k, "V": data.v})


def run(variant: str, device: str = "cpu"):
    gen = generator(136)
    steps = [tuple(randn(B, H_Q, s, D, gen=gen, device=device) for s in (S_Q, S_KV, S_KV)) for _ in range(STEPS)]
    handle = None

    def serve(graphed: bool):
        graph = Graph(variant, device)
        graph.build()
        data = SdpaTestData(graph.get_workspace_size(), device)
        variant_pack = data.build_variant_pack()
        if graphed:
            cudnn_cuda_graph = CudaGraph()
            graph.populate_cuda_graph(handle, variant_pack, data.get_workspace_ptr(), cudnn_cuda_graph)
            cuda_graph_exec, o = cudaGraphInstantiate(cudnn_cuda_graph, data, device)
        outs = []
        for q, k, v in steps:
            data.q.copy_(q)
            data.k.copy_(k)
            data.v.copy_(v)
            if graphed:
                outs.append(replay(cuda_graph_exec, o).clone())               # cudaGraphLaunch
            else:
                graph.execute(handle, data.build_variant_pack(), data.get_workspace_ptr())
                outs.append(data.o.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
