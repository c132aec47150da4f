"""Rebuilding an environment-first ``warp.fem`` space partition reads the group offsets back to the host inside capture.

Upstream: https://github.com/NVIDIA/warp/commit/2e1ad5c6366a76efe3510247fad1877cbd62743d ("Fix environment
partition graph capture (GH-1607)", merge request omniverse/warp!2580);
issue https://github.com/NVIDIA/warp/issues/1607.
Symptom: "Building a ``warp.fem`` space partition with ``environment_first=True`` is not CUDA graph-capturable for
multiple environments, even when ``max_node_count`` is provided ... During CUDA graph capture, the device-to-host
copy fails." (``make_space_partition(...)`` inside ``wp.ScopedCapture``).
Mechanism: ``EnvironmentSpacePartition.rebuild()`` marks each node with the lowest environment of the active cells
that use it (``node_environment_from_cells_kernel``), sorts nodes by environment with ``compress_node_indices(env_count
+ 1, node_env)`` on the device, and then always runs ``group_offsets_np = group_offsets.numpy()`` (a D2H copy and a
sync) to get ``env_node_count`` and ``partition_node_count = min(max_node_count, full_partition_node_count)``, and
uploads ``self._env_offsets = wp.array(np.minimum(group_offsets_np[:env_count + 1], partition_node_count))`` from
host numpy. Eagerly that only costs a sync; inside a capture the readback is refused, so no graph of the partition
rebuild can be made, although ``max_node_count`` already gives a host-known capacity (as ``NodePartition`` uses it).
Modelled with a grid of cells per environment, a degree-0 discontinuous space (one node per cell), an
``ExplicitGeometryPartition`` built from a per-step ``cell_mask``, and a per-environment sum over ``env_offsets``
(the ``LinearOperator`` batch offsets) as the consumer.
Doctor: sync-in-capture, at rebuild (``group_offsets.numpy()`` needs the device's values on the host while capturing).
Fix (upstream): with ``max_node_count >= 0``, ``partition_node_count = max_node_count`` and no readback (the
``.numpy()`` stays only in the uncapped branch); ``_env_offsets`` is a borrowed ``(env_count + 1,)`` array filled on
the device by ``_fill_environment_offsets`` (``min(group_offsets[i], partition_node_count)``);
``_make_space_to_partition`` gets ``active_node_offsets=group_offsets, active_node_offset_index=env_count`` so
``_scatter_active_partition_indices`` leaves the inactive tail unmapped; ``wp.copy`` is guarded by
``partition_node_count > 0``; the single-environment shortcut is limited to ``max_node_count < 0``.
"""
from __future__ import annotations

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/warp/commit/2e1ad5c6366a76efe3510247fad1877cbd62743d"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "rebuild"
SYMPTOM = "capturing make_space_partition(environment_first=True, max_node_count=5) fails on the D2H readback"

ENV_COUNT, CELLS_PER_ENV, MAX_CELL_COUNT, MAX_NODE_COUNT = 3, 2, 4, 5
CELL_COUNT = ENV_COUNT * CELLS_PER_ENV
NULL_NODE_INDEX = NULL_ELEMENT_INDEX = -1
MASKS = [[1, 0, 0, 1, 0, 0], [0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 1], [0, 0, 1, 1, 1, 0]]


class ExplicitGeometryPartition:
    """The active cells of ``cell_mask``, compacted into ``max_cell_count`` slots (tail = NULL_ELEMENT_INDEX)."""

    def __init__(self, cell_mask, max_cell_count):
        self.cell_mask, self.max_cell_count = cell_mask, max_cell_count
        self._cells = torch.empty(max_cell_count, dtype=torch.int64, device=cell_mask.device)

    def rebuild(self):
        order = torch.sort(1 - self.cell_mask, stable=True).indices[: self.max_cell_count]
        slot = torch.arange(self.max_cell_count, device=order.device)
        self._cells.copy_(torch.where(slot < self.cell_mask.sum(), order, NULL_ELEMENT_INDEX))

    def cell_index(self):
        return self._cells


def compress_node_indices(group_count, node_env):
    """Counting sort of the nodes by group, on the device: ``(group_offsets [group_count + 1], node_indices)``."""
    groups = torch.arange(group_count, device=node_env.device)
    counts = (node_env[None, :] == groups[:, None]).sum(1)
    group_offsets = torch.cat([torch.zeros(1, dtype=counts.dtype, device=counts.device), counts.cumsum(0)])
    return group_offsets, torch.sort(node_env, stable=True).indices


class EnvironmentSpacePartition:
    def __init__(self, geo_partition, max_node_count, variant, device):
        self.geo_partition, self.variant, self.device = geo_partition, variant, device
        self.space_node_count = CELL_COUNT                     # degree 0, discontinuous: one node per cell
        self.cell_env = (torch.arange(CELL_COUNT) // CELLS_PER_ENV).to(device)   # Grid2D(env_count=3)
        self._max_node_count = min(max_node_count, self.space_node_count)
        self._node_indices = self._space_to_partition = self._env_offsets = None
        self._node_count = 0
        self.rebuild()

    def node_environment_from_cells_kernel(self, node_env):
        cells = self.geo_partition.cell_index()
        active = cells != NULL_ELEMENT_INDEX
        safe = torch.where(active, cells, 0)
        env = torch.where(active, self.cell_env[safe], ENV_COUNT)
        node_env.scatter_reduce_(0, safe, env, reduce="amin")  # wp.atomic_min(node_env, space_nidx, env_index)

    def rebuild(self):
        env_count, max_node_count, device = ENV_COUNT, self._max_node_count, self.device
        node_env = torch.empty(self.space_node_count, dtype=torch.int64, device=device)
        node_env.fill_(env_count)
        self.node_environment_from_cells_kernel(node_env)
        group_offsets, node_indices = compress_node_indices(env_count + 1, node_env)

        if self.variant == "bug":
            group_offsets_np = group_offsets.cpu().numpy()                  # D2H copy + sync
            env_node_count = int(group_offsets_np[env_count])
            full_partition_node_count = env_node_count                   # not a WholeGeometryPartition
            partition_node_count = (min(max_node_count, full_partition_node_count) if max_node_count >= 0
                                    else full_partition_node_count)
            has_env_offsets, active_node_offsets = partition_node_count <= env_node_count, None
        elif max_node_count >= 0:
            partition_node_count, has_env_offsets, active_node_offsets = max_node_count, True, group_offsets
        else:
            env_node_count = int(group_offsets.cpu().numpy()[env_count])
            partition_node_count, active_node_offsets = env_node_count, None
            has_env_offsets = True

        if self._node_indices is None or self._node_indices.shape[0] != partition_node_count:
            self._node_indices = torch.empty(partition_node_count, dtype=torch.int64, device=device)
        if partition_node_count > 0:
            self._node_indices.copy_(node_indices[:partition_node_count])     # wp.copy(..., count=...)
        self._space_to_partition = self._make_space_to_partition(partition_node_count, active_node_offsets, env_count)
        self._node_count = partition_node_count

        if has_env_offsets and self.variant == "bug":
            self._env_offsets = torch.from_numpy(
                np.minimum(group_offsets_np[: env_count + 1], partition_node_count)).to(device)
        elif has_env_offsets:
            if self._env_offsets is None or self._env_offsets.shape != (env_count + 1,):
                self._env_offsets = torch.empty(env_count + 1, dtype=torch.int64, device=device)
            self._fill_environment_offsets(partition_node_count, group_offsets, self._env_offsets)
        else:
            self._env_offsets = None

    def _make_space_to_partition(self, partition_node_count, active_node_offsets, active_node_offset_index):
        space_to_partition = torch.empty(self.space_node_count, dtype=torch.int64, device=self.device)
        space_to_partition.fill_(NULL_NODE_INDEX)
        partition_idx = torch.arange(partition_node_count, device=self.device)
        if active_node_offsets is None:                         # _scatter_partition_indices
            values = partition_idx
        else:                                                   # _scatter_active_partition_indices
            values = torch.where(partition_idx < active_node_offsets[active_node_offset_index], partition_idx,
                                 NULL_NODE_INDEX)
        space_to_partition.scatter_(0, self._node_indices, values)
        return space_to_partition

    @staticmethod
    def _fill_environment_offsets(partition_node_count, group_offsets, env_offsets):
        env_offsets.copy_(torch.clamp(group_offsets[: env_offsets.shape[0]], max=partition_node_count))

    @property
    def env_offsets(self):
        return self._env_offsets

    def space_node_indices(self):
        return self._node_indices


def per_environment_sum(partition, node_values):
    """A consumer of ``env_offsets`` as batch offsets: the sum of each environment's partition-node values."""
    vals = node_values[partition.space_node_indices()]
    pos = torch.arange(vals.shape[0], device=vals.device)
    offs = partition.env_offsets
    inside = (pos[None, :] >= offs[:-1, None]) & (pos[None, :] < offs[1:, None])
    return (inside.to(vals.dtype) * vals[None, :]).sum(1)


def run(variant: str, device: str = "cpu"):
    gen = generator(1607)
    masks = [torch.tensor(m, dtype=torch.int64).to(device) for m in MASKS]
    fields = [randn(CELL_COUNT, gen=gen, device=device) for _ in MASKS]

    def step(geo_partition, node_values, partition=None):
        geo_partition.rebuild()
        if partition is None:                                  # fem.make_space_partition(...)
            partition = EnvironmentSpacePartition(geo_partition, MAX_NODE_COUNT, variant, device)
        else:
            partition.rebuild()
        return (partition.space_node_indices(), partition.env_offsets, partition._space_to_partition,
                per_environment_sum(partition, node_values)), partition

    def eager():
        cell_mask, node_values = masks[0].clone(), fields[0].clone()
        geo, outs, partition = ExplicitGeometryPartition(cell_mask, MAX_CELL_COUNT), [], None
        for m, f in zip(masks, fields):
            cell_mask.copy_(m)
            node_values.copy_(f)
            out, partition = step(geo, node_values, partition)
            outs += [t.clone() for t in out]
        return outs

    def served():
        cell_mask, node_values = masks[0].clone(), fields[0].clone()
        geo = ExplicitGeometryPartition(cell_mask, MAX_CELL_COUNT)
        _, partition = step(geo, node_values)                  # make_partition() before the capture
        g, out = capture(lambda: step(geo, node_values, partition)[0], device=device, warmups=1,
                         name="wp.ScopedCapture", static={"cell_mask": cell_mask, "node_values": node_values},
                         owner="warp.fem EnvironmentSpacePartition")
        outs = []
        for m, f in zip(masks, fields):
            cell_mask.copy_(m)
            node_values.copy_(f)
            outs += [t.clone() for t in replay(g, out)]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
