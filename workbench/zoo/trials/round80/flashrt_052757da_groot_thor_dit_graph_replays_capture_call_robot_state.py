"""FlashRT GR00T (Thor) encodes the robot state into the DiT graph's ``b_state_feat`` only at first-call capture; every later ``infer()`` replays with the first observation's state.

Upstream: https://github.com/flashrt-project/FlashRT/commit/052757daee4a83b8f9939fbc4ec919ebb527fbf3 ("fix(groot): guard
prompt runtime state reuse", 2026-05-28, pushed to main, no PR or issue), completed the same day by
https://github.com/flashrt-project/FlashRT/commit/3ec6ed74f019adfb755e32d51a3f96a450bf2361 ("fix(groot): encode per-step
state with the g_dit state encoder") and refactored by 439ca226 ("share one state-encode path for capture and infer").
Diffs read, and the pre-fix ``flash_rt/frontends/torch/groot_thor.py`` (``infer``, ``_capture_all_graphs``,
``_patch_embed_2views``, ``_run_pixel_unshuffle_mlp1``) and ``flash_rt/models/groot/pipeline_thor.py``
(``CKernelQwen3.forward``, ``CKernelDiTHead._alloc_buffers / precompute_cross_kv / _run_step``).
Symptom: no error. The first ``infer(obs)`` returns the right action chunk; from the second call on, the actions are
conditioned on the proprioceptive state of that first observation and ignore the arm's current joint state. The
non-graph paths (``infer_action_head``, ``infer_action_head_graph``) encode the state on every call and are right.
Mechanism: ``GrootTorchFrontendThor.infer(obs)`` calls ``_capture_all_graphs(obs)`` on its first call only (guarded by
``_graphs_built``). That function captures the SigLIP graph, runs the backbone on ``obs``, and then ("State encode
(outside graph)") encodes ``obs['state']`` eagerly through the DiT head's state encoder (``se_w1`` + bias + ReLU,
``se_w2`` + bias) and copies the result into the persistent ``self._g_dit.b_state_feat``. Then it captures the DiT
graph: ``for step in range(num_steps): self._g_dit._run_step(step)``. Each captured step begins with
``fvk.gpu_copy(self.b_hidden, self.b_state_feat, D*2)``: the state token is row 0 of the DiT's hidden sequence, and
the self-attention layers mix it into the action rows. On every call, before ``self._dit_graph.replay()``, ``infer``
refreshes the image patches (``_patch_embed_2views`` -> SigLIP replay -> ``_run_pixel_unshuffle_mlp1``), the input
embeddings (``_g_ie_buf`` -> Qwen3 replay), the cross-attention memory (``b_kv_text``/``b_kv_img`` ->
``precompute_cross_kv``) and the noise (``b_actions.normal_()``). It never rewrites ``b_state_feat``. So every replay
reads the state feature of the capture call. An eager run encodes each call's own state.
Doctor: stale-input, at infer (each replay's action rows depend on the DiT graph's static input ``b_state_feat``,
which ``infer`` does not write before the replay: a skipped per-call refresh, so the elements hold the capture call's
value; ``infer`` is where the fix added the refresh).
Fix (upstream): ``infer`` calls ``self._copy_state_feature_to_dit(obs.get('state', np.zeros(self.state_dim)))``
after ``precompute_cross_kv()`` and before the noise and the DiT replay. The new helper encodes the state through
``self._g_dit.se_w1/se_b1/se_w2/se_b2`` and does ``self._g_dit.b_state_feat.copy_(sf)``. (052757da's first version
called ``self._state_encode``, whose ``_state_enc_w*`` weights do not exist on the Thor pipeline and raised
AttributeError; 3ec6ed74 switched it to the DiT head's encoder.) 439ca226 routes the capture-time encode through the
same helper. The regression test ``test_groot_thor_infer_refreshes_state_before_dit_graph_replay`` checks that the
helper is called in ``infer`` before ``self._dit_graph.replay()``.
Modelled: float32 with torch ops for the fvk/cuBLAS kernels; no FP8, no calibration (``_calibrate_qwen3``,
``_calibrate_dit``), no attention backend, no tokenizer. Two 8x8 RGB views with 2x2 patches. SigLIP is one pre-norm
MLP block (applied in place on ``_sig_x``, as the residual stream upstream) plus the post-LN. The pixel-unshuffle + mlp1
projector runs eagerly, as upstream. Qwen3 is one causal layer (2 heads) + final RMS norm + the vlln LayerNorm, with
Se = 12 tokens, 8 of them image tokens. The DiT head has 4 layers (cross on the text / self / cross on the image /
self), D=16, 2 heads, horizon T=4, action_dim 6, state_dim 5, 4 Euler steps. Its AdaLN scales and shifts and its action
time embeddings are precomputed per step, as in ``_precompute``. Each capture has one eager warmup (three
upstream). The Qwen3 graph reads its input embeddings from
``ie_fp16``, which the frontend keeps as ``_g_ie_buf``. That aliasing was made explicit upstream in 64c862e5; before
it, a fresh ``_g_ie_buf`` only worked through the allocator's block reuse. It is used here so that only this bug shows.
The noise is drawn from a seeded generator per frontend: the capture-time draws (before the warmups and the capture)
use a separate one, so that the graph run and the eager run give the same noise to each ``infer``. The eager
reference (no graphs) builds the same kernels and, like ``infer_action_head``, encodes the state on every call. The
workload is three observations of a closed loop: the images and the robot state change on every call.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashrt-project/FlashRT/commit/052757daee4a83b8f9939fbc4ec919ebb527fbf3"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "infer"
SYMPTOM = ("GR00T Thor infer(): every DiT graph replay after the first call reads b_state_feat encoded from the "
           "capture call's robot state; actions ignore the current proprioception (no error)")

NUM_VIEWS, IMG, PATCH = 2, 8, 2
SPV_RAW = (IMG // PATCH) ** 2             # SigLIP tokens per view
SPV = SPV_RAW // 4                        # tokens per view after the 2x2 pixel unshuffle
D_SIG, D_LLM = 8, 16
SE, IMG_START = 12, 2                     # backbone sequence; image tokens at [2, 2 + NUM_VIEWS * SPV)
QW_NH, QW_HD, QW_H = 2, 8, 32
STATE_DIM, ACTION_DIM, ACTION_HORIZON = 5, 6, 4
SE_HIDDEN = 24                            # the state encoder's hidden width (1024 upstream)
OUT_HIDDEN = 24                           # proj_out_2 / action decoder width (1024 upstream)


def _ln(x, w=None, b=None, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _mha(q, k, v, nh, causal=False):
    """[Sq, nh*hd] x [Sk, nh*hd] -> [Sq, nh*hd] (fvk.attention_mha_fp16)."""
    sq, hd = q.shape[0], q.shape[1] // nh
    q, k, v = (t.reshape(-1, nh, hd).transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(0, 1).reshape(sq, nh * hd)


# --- flash_rt/models/groot/pipeline_thor.py ---------------------------------------------------------

class CKernelQwen3:
    """The Qwen3 backbone (one layer here); ``forward`` copies its input into ``b_x`` first, inside the graph."""

    def __init__(self, w, Se, device):
        self.Se, self.D = Se, D_LLM
        self.w = w
        self.b_x = torch.zeros(Se, D_LLM, device=device)
        self.b_xn = torch.zeros(Se, D_LLM, device=device)

    def forward(self, x_in):
        w = self.w
        self.b_x.copy_(x_in)                                              # fvk.gpu_copy(b_x, x_in)
        xn = _rms(self.b_x, w["ln_w"])
        qkv = xn @ w["qkv"]
        q, k, v = qkv.split(QW_NH * QW_HD, dim=-1)
        q = _rms(q.reshape(-1, QW_HD), w["q_norm_w"]).reshape(self.Se, -1)
        k = _rms(k.reshape(-1, QW_HD), w["k_norm_w"]).reshape(self.Se, -1)
        self.b_x.add_(_mha(q, k, v, QW_NH, causal=True) @ w["o_w"])
        xn = _rms(self.b_x, w["ln2_w"])
        gate, up = (xn @ w["gu"]).split(QW_H, dim=-1)
        self.b_x.add_((F.silu(gate) * up) @ w["down"])
        self.b_xn.copy_(_rms(self.b_x, w["final_norm_w"]))
        return self.b_xn


class CKernelDiTHead:
    """DiT action head, 4 flow-matching steps; ``_run_step`` reads ``b_state_feat`` as hidden row 0 every step."""

    def __init__(self, sd, action_horizon, backbone_shape, device):
        self.D, self.NH, self.H, self.L = 16, 2, 32, 4
        self.action_dim, self.num_steps = ACTION_DIM, 4
        self.T, self.Sa = action_horizon, 1 + action_horizon
        self.S_kv, self.D_kv = backbone_shape[1], backbone_shape[2]
        self.device = device
        self._load_weights(sd)
        self._precompute(sd)
        self._alloc_buffers()

    def _load_weights(self, sd):
        for k in ("se_w1", "se_b1", "se_w2", "se_b2", "ae_w1", "ae_b1", "ae_w2", "ae_b2", "ae_w3", "ae_b3",
                  "ad_w1", "ad_b1", "ad_w2", "ad_b2", "pos_emb", "proj_out_2_w", "proj_out_2_b"):
            setattr(self, k, sd[k])
        self.dit = sd["dit"]

    def _precompute(self, sd):
        """Per-step AdaLN scale/shift and action time embeddings (the timestep is fixed per step)."""
        D, T = self.D, self.T
        half = D // 2
        exp_d = (-torch.arange(half, dtype=torch.float32, device=self.device) * (math.log(10000.0) / half)).exp()
        ada_scales, ada_shifts, out_scales, out_shifts, time_embeds = [], [], [], [], []
        for step in range(self.num_steps):
            t_disc = int(step / float(self.num_steps) * 1000)
            args = torch.tensor([float(t_disc)], device=self.device)[:, None] * exp_d
            sincos = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
            temb = F.silu(sincos @ sd["ts_l1_w"] + sd["ts_l1_b"]) @ sd["ts_l2_w"] + sd["ts_l2_b"]
            silu_temb = F.silu(temb)
            sc_sh = [(silu_temb @ sd["ada_w"][l] + sd["ada_b"][l]).squeeze(0).chunk(2) for l in range(self.L)]
            ada_scales.append(torch.stack([s for s, _ in sc_sh]))
            ada_shifts.append(torch.stack([h for _, h in sc_sh]))
            o_sh, o_sc = (silu_temb @ sd["proj_out_1_w"] + sd["proj_out_1_b"]).squeeze(0).chunk(2)
            out_scales.append(o_sc)
            out_shifts.append(o_sh)
            freqs = torch.full((T, 1), float(t_disc), device=self.device) * exp_d
            time_embeds.append(torch.cat([torch.sin(freqs), torch.cos(freqs)], dim=-1))
        self.ada_scales, self.ada_shifts = torch.stack(ada_scales), torch.stack(ada_shifts)
        self.out_scales, self.out_shifts = torch.stack(out_scales), torch.stack(out_shifts)
        self.action_time_embeds = torch.stack(time_embeds)

    def _alloc_buffers(self):
        D, T, Sa, dev = self.D, self.T, self.Sa, self.device
        self.b_actions = torch.zeros(1, T, self.action_dim, device=dev)
        self.b_state_feat = torch.zeros(1, D, device=dev)
        self.b_kv_text = torch.zeros(self.S_kv, self.D_kv, device=dev)
        self.b_kv_img = torch.zeros(self.S_kv, self.D_kv, device=dev)
        n_cross = self.L // 2
        self._precomp_k = [torch.zeros(self.S_kv, D, device=dev) for _ in range(n_cross)]
        self._precomp_v = [torch.zeros(self.S_kv, D, device=dev) for _ in range(n_cross)]
        self.b_a_emb = torch.zeros(T, D, device=dev)
        self.b_hidden = torch.zeros(Sa, D, device=dev)
        self.b_velocity = torch.zeros(Sa, self.action_dim, device=dev)

    def precompute_cross_kv(self):
        """K/V of every cross-attention block from the backbone features (constant across the 4 steps)."""
        for block_idx in range(self.L // 2):
            l = block_idx * 2
            w = self.dit[l]
            kv_src = self.b_kv_text if l % 4 == 0 else self.b_kv_img
            self._precomp_k[block_idx].copy_(kv_src @ w["k_w"] + w["k_b"])
            self._precomp_v[block_idx].copy_(kv_src @ w["v_w"] + w["v_b"])

    def _run_step(self, step):
        D, T, dt = self.D, self.T, 1.0 / self.num_steps
        a = self.b_actions[0] @ self.ae_w1 + self.ae_b1
        h = F.silu(torch.cat([a, self.action_time_embeds[step]], dim=-1) @ self.ae_w2 + self.ae_b2)
        self.b_a_emb.copy_(h @ self.ae_w3 + self.ae_b3 + self.pos_emb[:T])
        self.b_hidden[:1].copy_(self.b_state_feat)                        # gpu_copy(b_hidden, b_state_feat, D*2)
        self.b_hidden[1:].copy_(self.b_a_emb)                             # gpu_copy(b_hidden + D*2, b_a_emb, T*D*2)
        for l in range(self.L):
            w = self.dit[l]
            h_norm = _ln(self.b_hidden) * (1 + self.ada_scales[step, l]) + self.ada_shifts[step, l]
            if l % 2 == 1:                                                # self-attention over [state; actions]
                q, k, v = (h_norm @ w["qkv_w"] + w["qkv_b"]).split(D, dim=-1)
                attn = _mha(q, k, v, self.NH)
            else:                                                         # cross-attention on the backbone
                q = h_norm @ w["q_w"] + w["q_b"]
                attn = _mha(q, self._precomp_k[l // 2], self._precomp_v[l // 2], self.NH)
            self.b_hidden.add_(attn @ w["o_w"] + w["o_b"])
            ff = F.gelu(_ln(self.b_hidden) @ w["ff_up_w"] + w["ff_up_b"], approximate="tanh")
            self.b_hidden.add_(ff @ w["ff_dn_w"] + w["ff_dn_b"])
        h_norm = _ln(self.b_hidden, eps=1e-6) * (1 + self.out_scales[step]) + self.out_shifts[step]
        model_out = h_norm @ self.proj_out_2_w + self.proj_out_2_b
        dec = F.relu(model_out @ self.ad_w1 + self.ad_b1)
        self.b_velocity.copy_(dec @ self.ad_w2 + self.ad_b2)
        self.b_actions[0].add_(dt * self.b_velocity[self.Sa - self.T:])   # fvk.gpu_euler_step(..., vel_offset)


# --- flash_rt/frontends/torch/groot_thor.py ---------------------------------------------------------

def _checkpoint(device):
    gen = generator(5275)
    r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale)  # noqa: E731
    D, H, L = 16, 32, 4
    sd = {
        "sig_patch_w": r(D_SIG, 3 * PATCH * PATCH), "sig_patch_b": r(D_SIG, scale=0.1),
        "sig_pos_embed": r(SPV_RAW, D_SIG, scale=0.3),
        "sig_ln_w": 1 + r(D_SIG, scale=0.1), "sig_ln_b": r(D_SIG, scale=0.1),
        "sig_fc1": r(D_SIG, 2 * D_SIG), "sig_fc2": r(2 * D_SIG, D_SIG),
        "sig_post_ln_w": 1 + r(D_SIG, scale=0.1), "sig_post_ln_b": r(D_SIG, scale=0.1),
        "mlp1_ln_w": 1 + r(4 * D_SIG, scale=0.1), "mlp1_ln_b": r(4 * D_SIG, scale=0.1),
        "mlp1_fc1_w": r(4 * D_SIG, D_LLM), "mlp1_fc1_b": r(D_LLM, scale=0.1),
        "mlp1_fc2_w": r(D_LLM, D_LLM), "mlp1_fc2_b": r(D_LLM, scale=0.1),
        "text_embed": r(SE, D_LLM, scale=1.0),
        "qwen3": {"ln_w": 1 + r(D_LLM, scale=0.1), "qkv": r(D_LLM, 3 * QW_NH * QW_HD),
                  "q_norm_w": 1 + r(QW_HD, scale=0.1), "k_norm_w": 1 + r(QW_HD, scale=0.1),
                  "o_w": r(QW_NH * QW_HD, D_LLM), "ln2_w": 1 + r(D_LLM, scale=0.1),
                  "gu": r(D_LLM, 2 * QW_H), "down": r(QW_H, D_LLM, scale=0.3),
                  "final_norm_w": 1 + r(D_LLM, scale=0.1)},
        "vlln_w": 1 + r(D_LLM, scale=0.1), "vlln_b": r(D_LLM, scale=0.1),
        "se_w1": r(STATE_DIM, SE_HIDDEN, scale=0.8), "se_b1": r(SE_HIDDEN, scale=0.1),
        "se_w2": r(SE_HIDDEN, D, scale=0.6), "se_b2": r(D, scale=0.1),
        "ae_w1": r(ACTION_DIM, D), "ae_b1": r(D, scale=0.1), "ae_w2": r(2 * D, D, scale=0.3),
        "ae_b2": r(D, scale=0.1), "ae_w3": r(D, D, scale=0.3), "ae_b3": r(D, scale=0.1),
        "pos_emb": r(ACTION_HORIZON, D, scale=0.3),
        "proj_out_2_w": r(D, OUT_HIDDEN, scale=0.4), "proj_out_2_b": r(OUT_HIDDEN, scale=0.1),
        "ad_w1": r(OUT_HIDDEN, OUT_HIDDEN, scale=0.3), "ad_b1": r(OUT_HIDDEN, scale=0.1),
        "ad_w2": r(OUT_HIDDEN, ACTION_DIM, scale=0.3), "ad_b2": r(ACTION_DIM, scale=0.1),
        "ts_l1_w": r(D, D, scale=0.3), "ts_l1_b": r(D, scale=0.1),
        "ts_l2_w": r(D, D, scale=0.3), "ts_l2_b": r(D, scale=0.1),
        "ada_w": [r(D, 2 * D, scale=0.2) for _ in range(L)], "ada_b": [r(2 * D, scale=0.1) for _ in range(L)],
        "proj_out_1_w": r(D, 2 * D, scale=0.2), "proj_out_1_b": r(2 * D, scale=0.1),
        "dit": [],
    }
    for l in range(L):
        w = {"o_w": r(D, D, scale=0.3), "o_b": r(D, scale=0.1),
             "ff_up_w": r(D, H, scale=0.3), "ff_up_b": r(H, scale=0.1),
             "ff_dn_w": r(H, D, scale=0.3), "ff_dn_b": r(D, scale=0.1)}
        if l % 2 == 1:
            w.update(qkv_w=r(D, 3 * D, scale=0.5), qkv_b=r(3 * D, scale=0.1))
        else:
            w.update(q_w=r(D, D, scale=0.5), q_b=r(D, scale=0.1), k_w=r(D_LLM, D, scale=0.5),
                     k_b=r(D, scale=0.1), v_w=r(D_LLM, D, scale=0.5), v_b=r(D, scale=0.1))
        sd["dit"].append(w)
    return sd


class GrootTorchFrontendThor:
    def __init__(self, device, variant, use_graphs=True):
        self.device, self.variant, self.use_graphs = device, variant, use_graphs
        self._full_sd = _checkpoint(device)
        self.state_dim, self.action_horizon, self._num_views = STATE_DIM, ACTION_HORIZON, NUM_VIEWS
        self._siglip_graph = self._qwen3_graph = self._dit_graph = None
        self._noise_gen = generator(4242)           # b_actions.normal_() of each infer()
        self._capture_noise_gen = generator(99)     # b_actions.normal_() of the capture call's warmups

    def set_prompt(self, prompt):
        """Tokenize; the text embeddings and the image/backbone masks of the Qwen3 sequence."""
        self._input_ids = prompt
        self._text_embeds = self._full_sd["text_embed"].unsqueeze(0)
        mask = torch.zeros(1, SE, dtype=torch.bool, device=self.device)
        mask[0, IMG_START:IMG_START + NUM_VIEWS * SPV] = True
        self._image_mask = mask
        self._backbone_mask = torch.ones(1, SE, dtype=torch.bool, device=self.device)
        self._backbone_mask[0, -1] = False          # one padded text position
        self._Se = SE

    def _normal_actions(self, gen):
        self._g_dit.b_actions.copy_(torch.randn(1, self.action_horizon, ACTION_DIM, generator=gen))

    # ── the kernels and their buffers (built at the start of _capture_all_graphs upstream) ──
    def _build_kernels(self):
        sd = self._full_sd
        self._g_qwen3 = CKernelQwen3(sd["qwen3"], self._Se, self.device)
        self._g_non_img = (~self._image_mask) & self._backbone_mask
        self._g_img_m = self._image_mask & self._backbone_mask
        self._g_dit = CKernelDiTHead(sd, self.action_horizon, (1, self._Se, D_LLM), self.device)
        S_sig, S_img = self._num_views * SPV_RAW, self._num_views * SPV
        self._sig_x = torch.zeros(S_sig, D_SIG, device=self.device)
        self._g_sig_postln = torch.zeros(S_sig, D_SIG, device=self.device)
        self._g_vision_out = torch.zeros(S_img, D_LLM, device=self.device)
        self._g_vlln_buf = torch.zeros(self._Se, D_LLM, device=self.device)
        self._g_ie_buf = torch.zeros(self._Se, D_LLM, device=self.device)

    def _patch_embed_2views(self, views):
        """Preprocess images -> SigLIP buffer (eager)."""
        sd = self._full_sd
        for idx, img in enumerate(views):
            pixel = ((img.to(self.device, torch.float32) / 255.0 - 0.5) / 0.5).permute(2, 0, 1).unsqueeze(0)
            patches = pixel.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)
            patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(SPV_RAW, -1)
            embedded = F.linear(patches, sd["sig_patch_w"], sd["sig_patch_b"]) + sd["sig_pos_embed"]
            self._sig_x[idx * SPV_RAW:(idx + 1) * SPV_RAW].copy_(embedded)

    def _run_sig(self):
        """siglip_forward (in place on the residual stream ``_sig_x``) + post-LN into ``_g_sig_postln``."""
        sd = self._full_sd
        self._sig_x.add_(F.gelu(_ln(self._sig_x, sd["sig_ln_w"], sd["sig_ln_b"]) @ sd["sig_fc1"],
                                approximate="tanh") @ sd["sig_fc2"])
        self._g_sig_postln.copy_(_ln(self._sig_x, sd["sig_post_ln_w"], sd["sig_post_ln_b"], eps=1e-6))
        return self._g_sig_postln

    def _run_pixel_unshuffle_mlp1(self):
        """Pixel unshuffle + mlp1 (runs outside graph)."""
        sd, nH = self._full_sd, IMG // PATCH
        flats = []
        for v in range(self._num_views):
            spatial = self._g_sig_postln[v * SPV_RAW:(v + 1) * SPV_RAW].reshape(1, nH, nH, D_SIG).permute(0, 3, 1, 2)
            flats.append(F.pixel_unshuffle(spatial, 2).reshape(4 * D_SIG, -1).T)
        x = _ln(torch.cat(flats, dim=0), sd["mlp1_ln_w"], sd["mlp1_ln_b"])
        x = F.gelu(x @ sd["mlp1_fc1_w"] + sd["mlp1_fc1_b"])
        self._g_vision_out.copy_(x @ sd["mlp1_fc2_w"] + sd["mlp1_fc2_b"])

    def _qwen3_vlln(self, ie):
        out = self._g_qwen3.forward(ie)
        self._g_vlln_buf.copy_(_ln(out, self._full_sd["vlln_w"], self._full_sd["vlln_b"]))
        return self._g_vlln_buf

    def _dit_steps(self):
        for step in range(self._g_dit.num_steps):
            self._g_dit._run_step(step)
        return self._g_dit.b_actions

    def _copy_state_feature_to_dit(self, state):
        """Encode current robot state into the captured DiT input buffer (the DiT head's se_w1/se_w2)."""
        state = torch.as_tensor(state, dtype=torch.float32).to(self.device)
        if state.dim() == 1:
            state = state.unsqueeze(0)
        dit = self._g_dit
        h = F.relu(state @ dit.se_w1 + dit.se_b1)
        sf = h @ dit.se_w2 + dit.se_b2
        dit.b_state_feat.copy_(sf)

    def _capture_all_graphs(self, obs):
        """One-time graph capture: SigLIP + Qwen3 + DiT (on the first infer() call)."""
        self._build_kernels()
        # ── 3. SigLIP graph ──
        self._siglip_graph, _ = capture(
            self._run_sig, device=self.device, warmups=1, name="groot siglip",
            owner="GrootTorchFrontendThor (SigLIP graph)", static={"_sig_x": self._sig_x})
        views = [obs["image"]] + ([obs["wrist_image"]] if "wrist_image" in obs and self._num_views >= 2 else [])
        self._patch_embed_2views(views)
        replay(self._siglip_graph, self._g_sig_postln)
        self._run_pixel_unshuffle_mlp1()
        input_embeds = self._text_embeds.clone()
        input_embeds[0, self._image_mask[0]] = self._g_vision_out
        ie_fp16 = input_embeds.squeeze(0).contiguous()
        # ── 4. Run Qwen3 (+ vlln) on the capture observation; backbone -> DiT cross-attention memory ──
        self._qwen3_vlln(ie_fp16)
        bb = self._g_vlln_buf.unsqueeze(0)
        self._g_dit.b_kv_text.copy_((bb * self._g_non_img.unsqueeze(-1)).squeeze(0))
        self._g_dit.b_kv_img.copy_((bb * self._g_img_m.unsqueeze(-1)).squeeze(0))
        self._g_dit.precompute_cross_kv()
        state = obs.get("state", torch.zeros(self.state_dim))
        if self.variant == "fix":
            self._copy_state_feature_to_dit(state)         # 439ca226: the shared helper
        else:
            # State encode (outside graph)
            state = torch.as_tensor(state, dtype=torch.float32).to(self.device)
            if state.dim() == 1:
                state = state.unsqueeze(0)
            h = F.relu(state @ self._g_dit.se_w1 + self._g_dit.se_b1)
            sf = h @ self._g_dit.se_w2 + self._g_dit.se_b2
            self._g_dit.b_state_feat.copy_(sf)
        # ── 5. DiT graph capture ──
        dit = self._g_dit
        self._normal_actions(self._capture_noise_gen)
        static = {"b_actions": dit.b_actions, "b_state_feat": dit.b_state_feat}
        static.update({f"_precomp_k[{i}]": t for i, t in enumerate(dit._precomp_k)})
        static.update({f"_precomp_v[{i}]": t for i, t in enumerate(dit._precomp_v)})
        self._dit_graph, _ = capture(self._dit_steps, device=self.device, warmups=1, name="groot dit 4 steps",
                                     owner="GrootTorchFrontendThor (DiT graph)", static=static)
        # ── 6. Qwen3 graph capture (its forward's first node copies from ie_fp16) ──
        self._qwen3_graph, _ = capture(lambda: self._qwen3_vlln(ie_fp16), device=self.device, warmups=1,
                                       name="groot qwen3", owner="GrootTorchFrontendThor (Qwen3 graph)",
                                       static={"ie_fp16": ie_fp16})
        self._g_ie_buf = ie_fp16                           # the buffer the Qwen3 graph reads (64c862e5)
        self._graphs_built = True

    def infer(self, obs):
        """Full GR00T inference: images + state -> actions. First call captures the graphs."""
        if not hasattr(self, "_input_ids"):
            raise RuntimeError("Call set_prompt() before infer()")
        if not self.use_graphs and not hasattr(self, "_g_dit"):
            self._build_kernels()
        if self.use_graphs and not getattr(self, "_graphs_built", False):
            self._capture_all_graphs(obs)
        # ── 1. SigLIP: patch embed + graph replay + mlp1 ──
        views = [obs["image"]] + ([obs["wrist_image"]] if "wrist_image" in obs and self._num_views >= 2 else [])
        self._patch_embed_2views(views)
        if self._siglip_graph is not None:
            replay(self._siglip_graph, self._g_sig_postln)
        else:
            self._run_sig()
        self._run_pixel_unshuffle_mlp1()
        # ── 2. Build input embeddings (pre-allocated buffer) ──
        self._g_ie_buf.copy_(self._text_embeds.squeeze(0))
        self._g_ie_buf[self._image_mask[0]] = self._g_vision_out
        self._g_qwen3.b_x.copy_(self._g_ie_buf)
        # ── 3. Qwen3 graph replay (+ vlln) ──
        if self._qwen3_graph is not None:
            replay(self._qwen3_graph, self._g_vlln_buf)
        else:
            self._qwen3_vlln(self._g_ie_buf)
        # ── 4. Update DiT KV + init noise ──
        bb = self._g_vlln_buf.unsqueeze(0)
        self._g_dit.b_kv_text.copy_((bb * self._g_non_img.unsqueeze(-1)).squeeze(0))
        self._g_dit.b_kv_img.copy_((bb * self._g_img_m.unsqueeze(-1)).squeeze(0))
        self._g_dit.precompute_cross_kv()
        state = obs.get("state", torch.zeros(self.state_dim))
        if self.variant == "fix":
            self._copy_state_feature_to_dit(state)
        self._normal_actions(self._noise_gen)
        # ── 5. DiT graph replay ──
        if self._dit_graph is not None:
            replay(self._dit_graph, self._g_dit.b_actions)
        else:
            # no graphs: the action head encodes this call's state (as infer_action_head does), then steps
            self._copy_state_feature_to_dit(state)
            self._dit_steps()
        return {"actions": self._g_dit.b_actions.squeeze(0).clone()}


def observations():
    gen = generator(8051)
    obs = []
    for _ in range(3):
        obs.append({"image": torch.randint(0, 256, (IMG, IMG, 3), generator=gen, dtype=torch.uint8),
                    "wrist_image": torch.randint(0, 256, (IMG, IMG, 3), generator=gen, dtype=torch.uint8),
                    "state": torch.randn(STATE_DIM, generator=gen)})
    return obs


def run(variant: str, device: str = "cpu"):
    obs = observations()

    def serve(use_graphs):
        policy = GrootTorchFrontendThor(device, variant, use_graphs=use_graphs)
        policy.set_prompt("pick up the cube and place it in the bowl")
        return [policy.infer(o)["actions"] for o in obs]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
