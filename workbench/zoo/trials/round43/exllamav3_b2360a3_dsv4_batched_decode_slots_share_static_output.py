"""DeepSeek-V4 batched decode concatenates per-slot graph outputs that are one shared static buffer.

Upstream: https://github.com/turboderp-org/exllamav3/commit/b2360a3beb3be04376984874aa5dbae5f7b12507
("DSv4: Don't overwrite static output sate when bsz > 1", a direct commit to ``master``; no PR).
Symptom: not reported beyond the fix's comment ("y is a shared static, overwritten by the next slot's
replay"): with the whole-step DSA decode graphs (``EXL3_BC_DSA=1``, the default) and more than one job in
the batch, every row of the attention output is the last job's, so every job but the last decodes from
another job's attention.
Mechanism: ``DSV4Attention._forward_cached`` processes the batch one job at a time,
``outs = [self._forward_cached_one(x[i:i+1], params, rsg[i], ...) for i in range(bsz)]``, then
``torch.cat(outs, dim=0)``. In ``_forward_cached_one`` each (cache layer, slot) has its own ``BCDsa``
(its own captured graph over that slot's ring), and ``y = bcd.run(x, rs, rsl)`` replays it and returns
its static output, which ``_forward_cached_one`` returned as is. That static is
``g_tensor_cache.get(dev, (seq, hidden), torch.float, "bcd_y")``: one tensor per (device, shape, dtype,
tag), shared by every ``BCDsa``. ``BCDsa.run``'s own docstring says "a static: consume before the next BC
call", but the list comprehension makes the next slot's BC call before ``torch.cat`` reads any element,
so every element of ``outs`` aliases the buffer that the last slot's replay wrote.
Doctor: overwritten-output, at ``_forward_cached`` (its ``torch.cat`` reads the slots' handed-out graph
outputs after later slots' replays overwrote them).
Fix (upstream): ``_forward_cached`` passes ``copy_static = bsz > 1`` and ``_forward_cached_one`` returns
``y.clone() if copy_static else y`` ("batch rows are assembled only after all slots have run"). The whole
diff (3 hunks) was read, with ``attention_fn/bc_dsa.py`` (``BCDsa._configure`` / ``run``).
Simplifications: one attention layer with a sliding-window ring per slot (no compressors, indexer, pools,
grouped o_proj or rope), a dense dot-product attention over the ring rows up to the position, float32
hidden states (upstream gates the graph path on fp16 input); the C++ ``BC_DSV4Attention`` graph is captured
with the workbench API, its input pointer patch is a copy into the shared ``bcd_x`` static, and the device
position scalar is filled directly instead of through its pinned host mirror; ``g_tensor_cache`` belongs to
the model instance instead of the process. The eager reference is the ``EXL3_BC_DSA=0`` path.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/turboderp-org/exllamav3/commit/b2360a3beb3be04376984874aa5dbae5f7b12507"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_forward_cached"
SYMPTOM = "with bsz > 1 every job's attention row is the last job's (shared static output of the per-slot graphs)"

HIDDEN, HEAD_DIM, RING_ROWS, VOCAB, MAX_SLOTS = 8, 8, 16, 16, 2
MAX_QLEN = 16


class TensorCache:
    """``util.tensor.g_tensor_cache``: one tensor per (device, shape, dtype, tag)."""

    def __init__(self):
        self.tensors = {}

    def get(self, device, shape, dtype, tag):
        key = (str(device), tuple(shape), dtype, tag)
        if key not in self.tensors:
            self.tensors[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self.tensors[key]


class RecurrentLayerState:
    """``rsl``: one cache layer's per-slot state (here only the sliding-window ring)."""

    def __init__(self, device):
        self.ring_rows = RING_ROWS
        self.ring = torch.zeros(MAX_SLOTS, RING_ROWS, HEAD_DIM, device=device)


class RecurrentCache:
    def __init__(self, device):
        self.layers = {}
        self.device = device

    def get_recurrent_layer(self, layer_instance):
        if layer_instance not in self.layers:
            self.layers[layer_instance] = RecurrentLayerState(self.device)
        return self.layers[layer_instance]


class RecurrentState:
    """``rs``: one job's decode state (its slot, position and window start)."""

    def __init__(self, cache, slot):
        self.cache, self.slot = cache, slot
        self.position, self.window_beg = 0, 0


def dsa_decode_step(module, x, ring, pos):
    """One attention step of one job: append this token's kv to the slot's ring at ``pos`` (a device
    scalar), attend over ring rows ``<= pos``, project out. The same kernels on both paths."""
    kv = x @ module.wkv                                              # [seq, HEAD_DIM]
    ring.index_copy_(0, pos.long(), kv)
    q = x @ module.wq
    scores = (q @ ring.T) * module.sm_scale
    scores = scores.masked_fill(module.ring_pos[None, :] > pos.long(), float("-inf"))
    return (torch.softmax(scores, -1) @ ring) @ module.wo           # [seq, HIDDEN]


class BCDsa:
    """``attention_fn/bc_dsa.py``: whole-attention-step graph of one (module, cache layer, job slot)."""

    def __init__(self, module, rs, rsl):
        self.module, self.device, self.slot = module, module.device, rs.slot
        key = ("bc_dsa_pos", self.device)
        store = rs.__dict__.setdefault("_bc_dsa_pos", {})       # shared by all layers of a job
        if key not in store:
            store[key] = (torch.zeros(1, dtype=torch.int32, device=self.device), [-1, -1])
        self.pos_dev, self.pos_mirror = store[key]
        self.ring = rsl.ring[rs.slot]                           # the slot's ring is baked into the graph
        self.graphs = {}                                        # seq -> (graph, static y)

    def _configure(self, seq):
        gtc = self.module.g_tensor_cache
        self.x_st = gtc.get(self.device, (seq, self.module.hidden_size), torch.float, "bcd_x")
        self.y_st = gtc.get(self.device, (seq, self.module.hidden_size), torch.float, "bcd_y")

    def run(self, x, rs, rsl):
        """x (1, seq, hidden). Returns y (1, seq, hidden) (a static: consume before the next BC call), or
        None to decline (host-side ring maintenance needed this step)."""
        seq = x.shape[1]
        pos, win_beg = rs.position, rs.window_beg
        if pos - win_beg + seq > rsl.ring_rows:
            return None
        if seq not in self.graphs:
            self._configure(seq)
        if self.pos_mirror[0] != pos or self.pos_mirror[1] != win_beg:
            self.pos_dev.fill_(pos)                              # one small host write per step per job
            self.pos_mirror[0], self.pos_mirror[1] = pos, win_beg
        self.x_st.copy_(x[0])                                    # the patched input pointer
        if seq not in self.graphs:
            x_st, y_st, ring, pos_dev, m = self.x_st, self.y_st, self.ring, self.pos_dev, self.module
            self.graphs[seq] = capture(lambda: y_st.copy_(dsa_decode_step(m, x_st, ring, pos_dev)),
                                       device=self.device, warmups=0, name=f"BC_DSV4Attention slot {self.slot}",
                                       owner=f"BCDsa (slot {self.slot})",
                                       static={"bcd_x": x_st, "pos_dev": pos_dev}, state={"ring": ring})
        g, y_static = self.graphs[seq]
        y = replay(g, y_static)
        return y.view(1, seq, self.module.hidden_size)


def build_bc_dsa(module, rs, rsl):
    return BCDsa(module, rs, rsl)


class DSV4Attention:
    def __init__(self, device, variant, bc_dsa_enable, layer_idx=0):
        gen = generator(2360)
        self.device, self.variant, self.layer_idx = device, variant, layer_idx
        self.bc_dsa_enable = bc_dsa_enable                       # EXL3_BC_DSA
        self.hidden_size = HIDDEN
        self.wkv = randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.wq = randn(HIDDEN, HEAD_DIM, gen=gen, device=device, scale=0.6)
        self.wo = randn(HEAD_DIM, HIDDEN, gen=gen, device=device, scale=0.6)
        self.sm_scale = 1.0 / math.sqrt(HEAD_DIM)
        self.ring_pos = torch.arange(RING_ROWS, device=device)
        self.g_tensor_cache = TensorCache()

    def _forward_cached(self, x, params, out_dtype):
        """Batch rows are processed per sequence: each row appends to its slot's ring, then attends."""
        rsg = params["recurrent_states"]
        bsz = x.shape[0]
        assert len(rsg) >= bsz
        layer_instance = (self.layer_idx, params.get("layer_instance", 0))
        copy_static = bsz > 1 if self.variant == "fix" else False
        outs = [
            self._forward_cached_one(x[i:i + 1], params, rsg[i], rsg[i].cache.get_recurrent_layer(layer_instance),
                                     out_dtype, copy_static=copy_static)
            for i in range(bsz)
        ]
        return torch.cat(outs, dim=0) if bsz > 1 else outs[0]

    def _forward_cached_one(self, x, params, rs, rsl, out_dtype, copy_static=False):
        _, seq, _ = x.shape
        # Whole-step graph path (EXL3_BC_DSA=1)
        if self.bc_dsa_enable and seq <= MAX_QLEN:
            if not hasattr(self, "_bc_dsa"):
                self._bc_dsa = {}
            key = (id(rsl), rs.slot)
            bcd = self._bc_dsa.get(key)
            if bcd is None:
                bcd = build_bc_dsa(self, rs, rsl)
                self._bc_dsa[key] = bcd if bcd is not None else False
            if bcd:
                y = bcd.run(x, rs, rsl)
                if y is not None:
                    # y is a shared static, overwritten by the next slot's replay; batch
                    # rows are assembled only after all slots have run
                    return y.clone() if copy_static else y
        # Eager path
        pos = torch.full((1,), rs.position, dtype=torch.int32, device=self.device)
        return dsa_decode_step(self, x[0], rsl.ring[rs.slot], pos).view(1, seq, self.hidden_size)


def run(variant: str, device: str = "cpu"):
    gen = generator(2360)
    emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
    # (job, token) per step; job 1 finishes after four steps and job 0 decodes alone once
    steps = [[(0, 3), (1, 9)], [(0, 12), (1, 4)], [(0, 7), (1, 15)], [(0, 1), (1, 6)], [(0, 10)]]

    def serve(graphed: bool):
        attn = DSV4Attention(device, variant, bc_dsa_enable=graphed)
        cache = RecurrentCache(device)
        jobs = [RecurrentState(cache, slot) for slot in range(MAX_SLOTS)]
        outs = []
        for step in steps:
            ids = torch.tensor([tok for _, tok in step])
            x = emb[ids.to(device)].view(len(step), 1, HIDDEN)
            rsg = [jobs[j] for j, _ in step]
            h = x + attn._forward_cached(x, {"recurrent_states": rsg}, torch.float)
            outs.append(h.view(len(step), HIDDEN).clone())
            for rs in rsg:
                rs.position += 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
