"""CLIP text encoder under DeepSpeed's DSClipEncoder CUDA graph: the pooled-output gather builds its batch index on the CPU, which the capture must copy to the GPU.

Upstream: https://github.com/huggingface/transformers/pull/19503 ("Create the arange tensor on device for enabling
CUDA-Graph for Clip Encoder", merged 2022-10). Read: the PR title and description ("changes the allocation of a tensor
at modeling_clip.py ... to happen at device side, to be able to use CUDA-Graph at DeepSpeed-Inference"). The diff was
not read: the one-line change (``torch.arange(last_hidden_state.shape[0])`` gains
``device=last_hidden_state.device`` in ``CLIPTextTransformer.forward``'s pooled-output gather) is reconstructed from the
description and from memory of ``modeling_clip.py``. Also read: DeepSpeed's ``DSClipEncoder``
(``deepspeed/model_implementations/transformers/clip_encoder.py`` at commit 87eaf8f99: two graphs toggled by
``self.iter`` for the conditional and unconditional prompt, three warmups, ``static_inputs = inputs``, and its own
device-side ``_build_causal_attention_mask`` patched onto ``enc.text_model``).
Symptom: with DeepSpeed-Inference's CUDA graph for the Stable Diffusion text encoder, capturing ``CLIPTextModel`` fails:
the capture hits a host-to-device copy.
Mechanism: ``CLIPTextTransformer.forward`` ends with ``pooled_output = last_hidden_state[torch.arange(bsz),
input_ids.to(torch.int).argmax(dim=-1)]``. ``torch.arange`` without a device makes a CPU tensor; indexing a CUDA tensor
with it makes torch copy the index to the GPU with a blocking host-to-device copy, which a capturing stream refuses.
The eager forward is unaffected (the copy is merely synchronous). ``DSClipEncoder._create_cuda_graph`` runs the
encoder three times eagerly and then inside ``torch.cuda.graph``, where the copy fails.
Doctor: sync-in-capture, at forward. ``CLIPTextTransformer.forward`` (the line the fix changes) asks for a blocking
host-to-device copy of its CPU ``arange`` while DSClipEncoder's stream is capturing.
Fix (upstream): ``torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device)``: the index is made by a
device kernel, which the graph records.
Modelled: ``DSClipEncoder`` as DeepSpeed wrote it (two toggled graphs, device-side causal mask, static inputs are the
first calls' tensors), a one-layer ``CLIPTextModel`` (token + position embeddings, causal self-attention with the
patched mask, MLP, final layer norm, pooled gather at the EOS = argmax id). Stand-ins: the CPU ``arange`` is
``host(torch.arange(...))`` and torch's implicit move of a CPU index to the device is written out as the blocking
``.to(device)`` it performs (on CUDA ``host`` gives pinned memory: the capture refuses the blocking copy all the same).
Workload: two prompts, each encoded as the pipeline does (conditional ids, then the unconditional ids), batch 2 x 6
tokens, hidden 8; four encoder calls, the first two capture graphs 0 and 1, the last two replay them. Eager runs
``enable_cuda_graph=False``. The bug raises at the first capture; the fix equals eager.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/transformers/pull/19503"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward"
SYMPTOM = ("DeepSpeed DSClipEncoder cannot capture CLIPTextModel: the pooled-output gather indexes the GPU hidden "
           "states with a CPU torch.arange, whose blocking copy to the GPU the capturing stream refuses")

VOCAB, SEQ, HID, BSZ = 12, 6, 8, 2
EOS = VOCAB - 1

_variant = "bug"


@dataclasses.dataclass
class BaseModelOutputWithPooling:
    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor


# --- transformers/models/clip/modeling_clip.py (reduced) ----------------------------------------------------------

def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


class CLIPTextTransformer:
    def __init__(self, device, gen):
        self.device = device
        self.token_embedding = randn(VOCAB, HID, gen=gen, device=device)
        self.position_embedding = randn(SEQ, HID, gen=gen, device=device, scale=0.3)
        self.wq, self.wk, self.wv, self.wo = (randn(HID, HID, gen=gen, device=device, scale=0.4) for _ in range(4))
        self.w1 = randn(HID, 2 * HID, gen=gen, device=device, scale=0.4)
        self.w2 = randn(2 * HID, HID, gen=gen, device=device, scale=0.4)
        self.ln_w = torch.ones(HID).to(device)
        self.ln_b = torch.zeros(HID).to(device)

    def _build_causal_attention_mask(self, bsz, seq_len, dtype):       # replaced by DSClipEncoder's
        mask = torch.empty(bsz, seq_len, seq_len, dtype=dtype)
        mask.fill_(torch.tensor(torch.finfo(dtype).min))
        return mask.triu_(1).unsqueeze(1)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        hidden_states = self.token_embedding[input_ids] + self.position_embedding[:seq_len]
        causal_attention_mask = self._build_causal_attention_mask(bsz, seq_len, hidden_states.dtype)
        q, k, v = hidden_states @ self.wq, hidden_states @ self.wk, hidden_states @ self.wv
        scores = (q @ k.transpose(1, 2)) / math.sqrt(HID) + causal_attention_mask[:, 0]
        hidden_states = hidden_states + torch.softmax(scores, -1) @ v @ self.wo
        hidden_states = hidden_states + torch.relu(hidden_states @ self.w1) @ self.w2
        last_hidden_state = _layer_norm(hidden_states, self.ln_w, self.ln_b)
        # text_embeds.shape = [batch_size, sequence_length, transformer.width]
        # take features from the eot embedding (eot_token is the highest number in each sequence)
        if _variant == "fix":
            batch_index = torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device)
        else:
            batch_index = host(torch.arange(last_hidden_state.shape[0]), self.device)       # a CPU tensor
            batch_index = batch_index.to(last_hidden_state.device)  # what indexing a GPU tensor does with it
        pooled_output = last_hidden_state[batch_index, input_ids.to(torch.int).argmax(dim=-1)]
        return BaseModelOutputWithPooling(last_hidden_state=last_hidden_state, pooler_output=pooled_output)


class CLIPTextModel:
    def __init__(self, device, gen):
        self.text_model = CLIPTextTransformer(device, gen)
        self.device, self.dtype, self.config = device, torch.float32, {"hidden_size": HID}

    def __call__(self, input_ids):
        return self.text_model.forward(input_ids)


# --- deepspeed/model_implementations/transformers/clip_encoder.py -------------------------------------------------

class DSClipEncoder:
    def __init__(self, enc, enable_cuda_graph=False):
        self.enable_cuda_graph = enable_cuda_graph
        enc.text_model._build_causal_attention_mask = self._build_causal_attention_mask
        self.enc, self.device, self.dtype = enc, enc.device, enc.dtype
        self.cuda_graph_created = [False, False]
        self.static_inputs, self.static_kwargs = [None, None], [None, None]
        self.static_output, self._cuda_graphs = [None, None], [None, None]
        self.iter = 0

    def _build_causal_attention_mask(self, bsz, seq_len, dtype):
        mask = torch.empty(bsz, seq_len, seq_len, dtype=dtype, device=self.device)
        mask.fill_(torch.tensor(torch.finfo(dtype).min))
        mask.triu_(1)
        return mask.unsqueeze(1)

    def _graph_replay(self, *inputs, **kwargs):
        for i in range(len(inputs)):
            if torch.is_tensor(inputs[i]):
                self.static_inputs[self.iter][i].copy_(inputs[i])
        last, pooled = replay(self._cuda_graphs[self.iter], self.static_output[self.iter])
        return BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled)

    def forward(self, *inputs, **kwargs):
        if self.enable_cuda_graph:
            if not self.cuda_graph_created[self.iter]:
                self._create_cuda_graph(*inputs, **kwargs)
            outputs = self._graph_replay(*inputs, **kwargs)
            self.iter = (self.iter + 1) % 2
            return outputs
        return self.enc(*inputs, **kwargs)

    __call__ = forward

    def _create_cuda_graph(self, *inputs, **kwargs):
        # warmup to create the workspace and cublas handle (three calls), then capture
        it = self.iter
        self.static_inputs[it], self.static_kwargs[it] = inputs, kwargs

        def step():
            out = self._forward(*self.static_inputs[it], **self.static_kwargs[it])
            return out.last_hidden_state, out.pooler_output

        self._cuda_graphs[it], self.static_output[it] = capture(
            step, device=self.device, warmups=3, name=f"DSClipEncoder[{it}]", owner="DSClipEncoder",
            static={f"static_inputs[{it}][{i}]": t for i, t in enumerate(inputs) if torch.is_tensor(t)})
        self.cuda_graph_created[it] = True

    def _forward(self, *inputs, **kwargs):
        return self.enc(*inputs, **kwargs)


# --- the workload: StableDiffusionPipeline._encode_prompt, conditional then unconditional ----------------------------

PROMPTS = [[[3, 7, 1, EOS, 0, 0], [5, 2, 9, 4, EOS, 0]], [[8, 8, EOS, 0, 0, 0], [1, 6, 2, 7, 3, EOS]]]
UNCOND = [[EOS, 0, 0, 0, 0, 0]] * BSZ


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [torch.tensor(p, dtype=torch.long).to(device) for p in PROMPTS]
    uncond = torch.tensor(UNCOND, dtype=torch.long).to(device)

    def serve(enable_cuda_graph):
        text_encoder = DSClipEncoder(CLIPTextModel(device, generator(19503)), enable_cuda_graph=enable_cuda_graph)
        outs = []
        for ids in prompts:
            for batch in (ids, uncond):
                out = text_encoder(batch.clone())
                outs += [out.last_hidden_state.clone(), out.pooler_output.clone()]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
