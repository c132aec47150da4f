"""DSClipEncoder serves the prompt and the unconditional prompt from one graph: the second replay overwrites the first's embeddings.

Upstream: https://github.com/deepspeedai/DeepSpeed/pull/2491 ("Stable Diffusion Enhancements", commit
e7e7595502; DSClipEncoder gets one CUDA graph per call of a pipeline step, ``self.iter`` alternating).
Symptom: ``deepspeed.init_inference(pipe, ...)`` on a Stable Diffusion pipeline with the CLIP text
encoder under DeepSpeed's CUDA graph (DeepSpeed 0.7.x, autumn 2022) loses classifier-free guidance:
the conditional text embeddings the pipeline holds become the unconditional ones, so the guided noise
prediction equals the unconditional one and the image no longer follows the prompt. Nothing raises.
The PR gives no user report; the symptom follows from the diff.
Mechanism: ``_encode_prompt`` calls the text encoder twice per image: first on the prompt (it keeps
``text_embeddings``), then on the empty prompt for ``uncond_embeddings``, and only then concatenates
them. ``DSClipEncoder`` captured one graph and ``_graph_replay`` returned its static output itself,
not a copy. The second call replays the same graph into the same output tensors, so the tensor the
pipeline still holds as ``text_embeddings`` now holds the unconditional embeddings.
Doctor: overwritten-output, at ``_graph_replay`` (it hands out the static output that the next replay
of the same graph rewrites while the caller still holds it).
Fix (upstream): keep two graphs, with separate static inputs and outputs, and alternate between them
(``self.iter = (self.iter + 1) % 2``): the prompt and the unconditional prompt each have their own
output buffers.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/deepspeedai/DeepSpeed/pull/2491"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_graph_replay"
SYMPTOM = "classifier-free guidance collapses: the prompt's embeddings are overwritten by the empty prompt's"
VOCAB, DIM, SEQ, STEPS, GUIDANCE = 12, 4, 5, 3, 7.5
BOS, EOS = 0, 1


class CLIPTextModel:
    """The text encoder: returns ``(last_hidden_state, pooler_output)``."""

    def __init__(self, device):
        gen = generator(2491)
        self.device = device
        self.dtype = torch.float32
        self.token_embedding = randn(VOCAB, DIM, gen=gen, device=device)
        self.position_embedding = randn(SEQ, DIM, gen=gen, device=device, scale=0.3)
        self.w = randn(DIM, DIM, gen=gen, device=device, scale=0.7)

    def __call__(self, input_ids):
        h = self.token_embedding[input_ids] + self.position_embedding
        last_hidden_state = torch.tanh(h @ self.w)
        return last_hidden_state, last_hidden_state[:, -1]


class DSClipEncoder:
    """``deepspeed.model_implementations.transformers.clip_encoder.DSClipEncoder``: the encoder under a
    CUDA graph. ``two_graphs`` is the fix: one graph (and static output) per call of a pipeline step."""

    def __init__(self, enc, device, two_graphs: bool):
        self.enc = enc
        self.device = device
        self.two_graphs = two_graphs
        if two_graphs:
            self.cuda_graph_created = [False, False]
            self.static_inputs = [None, None]
            self.static_output = [None, None]
            self._cuda_graphs = [None, None]
            self.iter = 0
        else:
            self.cuda_graph_created = False

    def _graph_replay(self, *inputs):
        if self.two_graphs:
            for i in range(len(inputs)):
                if torch.is_tensor(inputs[i]):
                    self.static_inputs[self.iter][i].copy_(inputs[i])
            return replay(self._cuda_graphs[self.iter], self.static_output[self.iter])
        for i in range(len(inputs)):
            if torch.is_tensor(inputs[i]):
                self.static_inputs[i].copy_(inputs[i])
        return replay(self._cuda_graphs, self.static_output)

    def __call__(self, *inputs):
        if self.two_graphs:
            if self.cuda_graph_created[self.iter]:
                outputs = self._graph_replay(*inputs)
            else:
                self._create_cuda_graph(*inputs)
                outputs = self._graph_replay(*inputs)
            self.iter = (self.iter + 1) % 2
            return outputs
        if self.cuda_graph_created:
            outputs = self._graph_replay(*inputs)
        else:
            self._create_cuda_graph(*inputs)
            outputs = self._graph_replay(*inputs)
        return outputs

    def _create_cuda_graph(self, *inputs):
        # warmup to create the workspace and cublas handle, then capture with the call's own inputs
        if self.two_graphs:
            self.static_inputs[self.iter] = inputs
            static = self.static_inputs[self.iter]
            self._cuda_graphs[self.iter], self.static_output[self.iter] = capture(
                lambda: self._forward(*static), device=self.device, warmups=3,
                static={"input_ids": static[0]}, owner=f"DSClipEncoder (graph {self.iter})")
            self.cuda_graph_created[self.iter] = True
        else:
            self.static_inputs = inputs
            self._cuda_graphs, self.static_output = capture(
                lambda: self._forward(*self.static_inputs), device=self.device, warmups=3,
                static={"input_ids": inputs[0]}, owner="DSClipEncoder")
            self.cuda_graph_created = True

    def _forward(self, *inputs):
        return self.enc(*inputs)


class UNet:
    """A stand-in denoiser conditioned on the pooled text embeddings."""

    def __init__(self, device):
        gen = generator(7)
        self.w_lat = randn(DIM, DIM, gen=gen, device=device, scale=0.5)
        self.w_txt = randn(DIM, DIM, gen=gen, device=device, scale=0.5)

    def __call__(self, latents, t, encoder_hidden_states):
        cond = encoder_hidden_states.mean(1)
        return torch.tanh(latents @ self.w_lat + cond @ self.w_txt) * (1.0 + 0.1 * t)


class StableDiffusionPipeline:
    def __init__(self, text_encoder, unet):
        self.text_encoder = text_encoder
        self.unet = unet

    def _encode_prompt(self, text_input_ids, uncond_input_ids):
        text_embeddings = self.text_encoder(text_input_ids)[0]
        # classifier free guidance: the unconditional embeddings come from a second encoder call
        uncond_embeddings = self.text_encoder(uncond_input_ids)[0]
        return torch.cat([uncond_embeddings, text_embeddings])

    def __call__(self, text_input_ids, uncond_input_ids, latents):
        text_embeddings = self._encode_prompt(text_input_ids, uncond_input_ids)
        for t in range(STEPS):
            latent_model_input = torch.cat([latents] * 2)
            noise_pred = self.unet(latent_model_input, t, text_embeddings)
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + GUIDANCE * (noise_pred_text - noise_pred_uncond)
            latents = latents - 0.1 * noise_pred
        return latents


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.cat([torch.tensor([[BOS]]), torch.randint(2, VOCAB, (1, SEQ - 2), generator=gen),
                          torch.tensor([[EOS]])], dim=1) for _ in range(2)]
    uncond = torch.tensor([[BOS] + [EOS] * (SEQ - 1)])
    latents0 = [torch.randn(1, DIM, generator=gen) for _ in prompts]

    def generate(text_encoder_for):
        enc, unet = CLIPTextModel(device), UNet(device)
        pipe = StableDiffusionPipeline(text_encoder_for(enc), unet)
        images = []
        for ids, lat in zip(prompts, latents0):
            # the tokenizer's output: fresh tensors for every image
            images.append(pipe(ids.to(device), uncond.to(device), lat.to(device)).clone())
        return images

    def eager():
        return generate(lambda enc: enc)

    def served():
        return generate(lambda enc: DSClipEncoder(enc, device, two_graphs=(variant == "fix")))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
