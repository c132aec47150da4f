"""SAM2's video tracker keeps one frame's cudagraph outputs in its memory bank; the next frame's replay overwrites them.

Upstream: https://github.com/pytorch/ao/pull/1386 ("SAM2: video_profile.py"), whose branch commit e332530ec
("Some clones for CUDA graphs") is the fix.
Symptom: with ``predictor._forward_sam_heads`` and ``predictor.memory_encoder.forward`` compiled with
``torch.compile(mode="max-autotune", fullgraph=True, dynamic=False)`` (cudagraph trees), the tracker's memory of
earlier frames is silently replaced by the latest frame's: from the third frame on the masks drift away from
eager (cudagraph trees may instead raise "accessing tensor output of CUDAGraphs that has been overwritten by a
subsequent run"). There is no issue; the commit title names the cure.
Mechanism: ``SAM2Base.track_step`` runs once per frame. It calls ``_forward_sam_heads`` (a graph: its
``low_res_masks``, ``high_res_masks``, ``obj_ptr`` and ``object_score_logits`` are static outputs in the graph
pool) and puts them as they are into the frame's ``current_out``; ``_encode_memory_in_output`` ->
``_encode_new_memory`` calls ``memory_encoder`` (a second graph) and keeps ``maskmem_out["vision_features"]``
and ``["vision_pos_enc"]`` as the frame's ``maskmem_features`` / ``maskmem_pos_enc`` (then adds the
``no_obj_embed_spatial`` in place, into the graph's output). ``_run_single_frame_inference`` stores these
(``.to(storage_device)`` is a no-op on the GPU) in ``output_dict``, and
``_prepare_memory_conditioned_features`` of every later frame reads the conditioning frame's and the recent
frames' ``maskmem_features`` and ``obj_ptr`` from it. The next frame's replay of the same two graphs rewrites
those static outputs, so every stored entry of the bank is the latest frame's: frame t+1 still sees frame t
correctly (its replays have not run yet), but from frame 2 on the conditioning frame's memory and object
pointer are gone.
Doctor: overwritten-output, at ``track_step`` (it stores graph-owned outputs in the per-frame memory bank,
read by later frames after the next replay of the same graph has overwritten them).
Fix (upstream): ``.clone()`` at the points where outputs escape into the bank: in ``track_step``
``current_out["pred_masks"/"pred_masks_high_res"/"obj_ptr"/"object_score_logits"] = ....clone()`` and
``object_score_logits.clone()`` passed on to ``_encode_memory_in_output``; in ``_encode_new_memory``
``maskmem_out["vision_features"].clone()`` and ``[m.clone() for m in maskmem_out["vision_pos_enc"]]``.
(Read: ``git show e332530ec`` and the compile setup of ``examples/sam2_amg_server/video_profile.py`` in
8a805d088. ``CompiledFn`` stands for ``torch.compile(..., mode="max-autotune")``: static inputs, warm-up and
capture at the first call, the static outputs returned by each replay. The heads, encoder and memory
attention are tiny stand-ins with SAM2's names and data flow.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/pytorch/ao/pull/1386"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "track_step"
SYMPTOM = "masks drift from frame 2: the memory bank's object pointers and memory features are the latest frame's"

HIDDEN_DIM, MEM_DIM, HW = 4, 4, 6          # hidden_dim, mem_dim, H*W tokens of the top-level feature map
NUM_MASKMEM, NUM_FRAMES = 3, 6             # memory frames: the conditioning frame + the 2 most recent


class CompiledFn:
    """``torch.compile(fn, mode="max-autotune")`` (cudagraph trees): arguments copied into static inputs,
    warm-up and capture at the first call, every call answered by a replay with the graph's static outputs."""

    def __init__(self, fn, name, device):
        self.fn, self.name, self.device = fn, name, device
        self.static_inputs, self.graph, self.static_outputs = None, None, None

    def __call__(self, *args):
        if self.graph is None:
            self.static_inputs = [a.clone() for a in args]
            self.graph, self.static_outputs = capture(
                lambda: self.fn(*self.static_inputs), device=self.device, warmups=1, name=self.name,
                owner=f"torch.compile({self.name}, mode='max-autotune')",
                static={f"arg{i}": s for i, s in enumerate(self.static_inputs)})
        for s, a in zip(self.static_inputs, args):
            s.copy_(a)
        return replay(self.graph, self.static_outputs)


class SAM2VideoPredictor:
    """``SAM2Base`` + ``SAM2VideoPredictor`` in miniature, one object (batch 1), point prompt on frame 0."""

    def __init__(self, device, variant, compiled):
        gen = generator(1386)
        self.variant, self.device = variant, device
        self.no_mem_embed = randn(HIDDEN_DIM, gen=gen, device=device, scale=0.1)
        self.w_mask = randn(HIDDEN_DIM, gen=gen, device=device)
        self.w_obj_ptr = randn(HIDDEN_DIM, HIDDEN_DIM, gen=gen, device=device, scale=0.5)
        self.w_score = randn(HIDDEN_DIM, gen=gen, device=device)
        self.w_mem_enc = randn(HIDDEN_DIM, MEM_DIM, gen=gen, device=device, scale=0.5)
        self.mem_pos = randn(HW, MEM_DIM, gen=gen, device=device, scale=0.1)
        self.maskmem_tpos_enc = randn(NUM_MASKMEM, MEM_DIM, gen=gen, device=device, scale=0.1)
        self.no_obj_embed_spatial = randn(MEM_DIM, gen=gen, device=device, scale=0.5)
        self.obj_ptr_proj = randn(HIDDEN_DIM, MEM_DIM, gen=gen, device=device, scale=0.5)
        self.w_q = randn(HIDDEN_DIM, MEM_DIM, gen=gen, device=device, scale=0.5)
        self.w_o = randn(MEM_DIM, HIDDEN_DIM, gen=gen, device=device, scale=0.5)
        if compiled:   # video_profile.py: predictor._forward_sam_heads / memory_encoder.forward = torch.compile(...)
            self._forward_sam_heads = CompiledFn(self._forward_sam_heads, "_forward_sam_heads", device)
            self.memory_encoder = CompiledFn(self.memory_encoder, "memory_encoder", device)

    # ---- compiled pieces (cudagraphs)
    def _forward_sam_heads(self, backbone_features):
        tokens = torch.tanh(backbone_features)
        low_res_masks = tokens @ self.w_mask                                   # [HW]
        high_res_masks = low_res_masks.repeat_interleave(2)                    # [2*HW] (upscaled)
        pooled = tokens.mean(0)
        obj_ptr = torch.tanh(pooled @ self.w_obj_ptr)                          # [C]
        object_score_logits = (pooled * self.w_score).sum(0, keepdim=True)     # [1]
        return low_res_masks, high_res_masks, obj_ptr, object_score_logits

    def memory_encoder(self, pix_feat, masks):
        mask = masks.view(HW, 2).mean(1)                                       # downsample the mask
        vision_features = torch.tanh((pix_feat * mask[:, None]) @ self.w_mem_enc)
        return vision_features, self.mem_pos * 1.0                            # vision_features, vision_pos_enc

    # ---- eager SAM2Base code
    def _prepare_memory_conditioned_features(self, frame_idx, current_vision_feats, output_dict):
        if frame_idx == 0:                                                     # init conditioning frame
            return current_vision_feats + self.no_mem_embed
        to_cat_memory, to_cat_memory_pos_embed = [], []
        cond = output_dict["cond_frame_outputs"][0]
        prevs = [(0, cond)] + [(t_pos, output_dict["non_cond_frame_outputs"].get(frame_idx - t_pos))
                               for t_pos in range(1, NUM_MASKMEM)]
        for t_pos, prev in prevs:
            if prev is None:
                continue
            to_cat_memory.append(prev["maskmem_features"])
            to_cat_memory_pos_embed.append(prev["maskmem_pos_enc"][-1] + self.maskmem_tpos_enc[NUM_MASKMEM - t_pos - 1])
        ptrs = [cond["obj_ptr"]] + [output_dict["non_cond_frame_outputs"][t]["obj_ptr"]
                                    for t in range(max(1, frame_idx - NUM_MASKMEM), frame_idx)]
        obj_ptrs = torch.stack(ptrs) @ self.obj_ptr_proj                       # object pointers as memory tokens
        memory = torch.cat(to_cat_memory + [obj_ptrs])
        memory_pos_embed = torch.cat(to_cat_memory_pos_embed + [torch.zeros_like(obj_ptrs)])
        return self.memory_attention(current_vision_feats, memory, memory_pos_embed)

    def memory_attention(self, curr, memory, memory_pos):
        attn = torch.softmax((curr @ self.w_q) @ (memory + memory_pos).T / MEM_DIM ** 0.5, dim=-1)
        return curr + (attn @ memory) @ self.w_o

    def _encode_new_memory(self, current_vision_feats, pred_masks_high_res, object_score_logits):
        mask_for_mem = torch.sigmoid(pred_masks_high_res)
        maskmem_out = self.memory_encoder(current_vision_feats, mask_for_mem)
        if self.variant == "fix":
            maskmem_features = maskmem_out[0].clone()
            maskmem_pos_enc = [m.clone() for m in maskmem_out[1:]]
        else:
            maskmem_features = maskmem_out[0]
            maskmem_pos_enc = list(maskmem_out[1:])
        is_obj_appearing = (object_score_logits > 0).float()
        maskmem_features += (1 - is_obj_appearing[..., None]) * self.no_obj_embed_spatial.expand(
            *maskmem_features.shape)
        return maskmem_features, maskmem_pos_enc

    def _encode_memory_in_output(self, current_vision_feats, high_res_masks, object_score_logits, current_out):
        maskmem_features, maskmem_pos_enc = self._encode_new_memory(current_vision_feats, high_res_masks,
                                                                    object_score_logits)
        current_out["maskmem_features"] = maskmem_features
        current_out["maskmem_pos_enc"] = maskmem_pos_enc

    def track_step(self, frame_idx, current_vision_feats, output_dict):
        current_out = {}
        pix_feat = self._prepare_memory_conditioned_features(frame_idx, current_vision_feats, output_dict)
        low_res_masks, high_res_masks, obj_ptr, object_score_logits = self._forward_sam_heads(pix_feat)
        if self.variant == "fix":
            current_out["pred_masks"] = low_res_masks.clone()
            current_out["pred_masks_high_res"] = high_res_masks.clone()
            current_out["obj_ptr"] = obj_ptr.clone()
            current_out["object_score_logits"] = object_score_logits.clone()
            score_for_mem = object_score_logits.clone()
        else:
            current_out["pred_masks"] = low_res_masks
            current_out["pred_masks_high_res"] = high_res_masks
            current_out["obj_ptr"] = obj_ptr
            current_out["object_score_logits"] = object_score_logits
            score_for_mem = object_score_logits
        self._encode_memory_in_output(current_vision_feats, high_res_masks, score_for_mem, current_out)
        return current_out

    def _run_single_frame_inference(self, output_dict, frame_idx, current_vision_feats):
        current_out = self.track_step(frame_idx, current_vision_feats, output_dict)
        storage_device = self.device                   # offload_state_to_cpu=False: .to() is a no-op
        compact_current_out = {
            "maskmem_features": current_out["maskmem_features"].to(storage_device, non_blocking=True),
            "maskmem_pos_enc": current_out["maskmem_pos_enc"],
            "pred_masks": current_out["pred_masks"].to(storage_device, non_blocking=True),
            "obj_ptr": current_out["obj_ptr"],
            "object_score_logits": current_out["object_score_logits"],
        }
        return compact_current_out, current_out["pred_masks"]

    def propagate_in_video(self, frames):
        output_dict = {"cond_frame_outputs": {}, "non_cond_frame_outputs": {}}
        for frame_idx, feats in enumerate(frames):
            current_out, pred_masks = self._run_single_frame_inference(output_dict, frame_idx, feats)
            storage_key = "cond_frame_outputs" if frame_idx == 0 else "non_cond_frame_outputs"
            output_dict[storage_key][frame_idx] = current_out
            video_res_masks = pred_masks.repeat_interleave(4)           # _get_orig_video_res_output
            yield frame_idx, video_res_masks


def run(variant: str, device: str = "cpu"):
    gen = generator(2024)
    frames = [torch.randn(HW, HIDDEN_DIM, generator=gen) for _ in range(NUM_FRAMES)]

    def track(compiled):
        predictor = SAM2VideoPredictor(device, variant, compiled)
        return [masks.clone() for _, masks in predictor.propagate_in_video([f.to(device) for f in frames])]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: track(True), lambda: track(False))
