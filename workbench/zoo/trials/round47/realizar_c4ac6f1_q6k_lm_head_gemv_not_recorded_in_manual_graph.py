"""The Q6K LM-head GEMV runs in the recording pass but never records itself: replays never write ``logits_buf``.

Upstream: https://github.com/paiml/realizar/commit/c4ac6f151d7ee4fe05430e1af2242ba0df671561 ("fix: add graph recording
to ALL GEMV quant variants (Q6K/Q5K/Q4_0/Q4_1/Q5_0/Q8_0/F32) (Refs #198)"), a direct commit on main (no PR); issue
https://github.com/paiml/realizar/issues/198 ("Manual graph replay produces garbled output").
Symptom: with the manual CUDA graph (trueno#243), the first generated token is right and the rest degenerate into
repetition ("I'm'm'm'm..."); the logits read back are identical at every position until the fix (after it,
"pos=10,11,12,13 produce distinct logits").
Mechanism: realizar builds its decode graph without stream capture (trueno#243, driver 570 code 901):
``try_first_token_graph_capture`` calls ``begin_graph_recording()`` (``graph_recording = true``), runs one EAGER
forward (``forward_workspace_captured``; every kernel executes), and ``end_graph_recording()`` turns
``graph_recorded_kernels`` into a graph with ``cuGraphAddKernelNode``, one node per ``RecordedKernel``. Each launch
site records itself after its launch (``if self.graph_recording { push(RecordedKernel {func, config, arg_data}) }``),
but of the GEMV variants only ``hw_dp4a_q4k_gemv_into`` had that block. The LM head is Q6K: ``q6k_gemv_into`` wrote
``workspace.logits_buf`` during the recording pass (the correct first token) and was never a node of the graph
(590 kernels recorded, 619 after the fix). ``forward_graphed_replay`` updates ``position_buf``/``graph_input_buf``,
launches the graph and downloads ``logits_buf``, which still holds the recording pass's logits. Modelled with one
layer (RMSNorm, a Q4K projection, an indirect RoPE, a residual, RMSNorm, the Q6K LM head).
Doctor: warmup-divergence, at q6k_gemv_into (the recording pass decides the graph's kernel list; this launch site
runs but leaves itself out, so the replayed plan lacks the LM head that every eager step runs).
Fix (upstream): the same recording block added to the ten other GEMV launch sites (``q6k_gemv_into``,
``mwv_q6k_gemv_into``, ``dp4a_q6k_gemv_into``, ``q5k_gemv_into``, ``q4_0``/``q4_1``/``q5_0``/``q8_0``/``f32_gemv_into``
and the rest).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/paiml/realizar/commit/c4ac6f151d7ee4fe05430e1af2242ba0df671561"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "q6k_gemv_into"
SYMPTOM = "every replayed decode step returns the recording pass's logits: output degenerates into repetition"

VOCAB, HIDDEN, THETA, EPS = 16, 4, 10.0, 1e-6


@dataclasses.dataclass
class RecordedKernel:
    func: object
    arg_data: tuple

    def launch(self):
        self.func(*self.arg_data)


# ---- the kernels: each writes the output buffer it is given ----
def rmsnorm_kernel(output, input, gamma):
    output.copy_(input * torch.rsqrt(input.pow(2).mean(-1, keepdim=True) + EPS) * gamma)


def gemv_kernel(output, weights, input):
    output.copy_(input @ weights)


def rope_indirect_kernel(output, input, position_buf, inv_freq):
    half = HIDDEN // 2
    ang = position_buf.to(input.dtype)[:, None] * inv_freq[None, :]
    x1, x2 = input[:, :half], input[:, half:]
    output.copy_(torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1))


def residual_add_kernel(output, a, b):
    torch.add(a, b, out=output)


class Weights:
    def __init__(self, device):
        gen = generator(198)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.attn_norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.w_q4k = randn(HIDDEN, HIDDEN, gen=gen, device=device)
        self.output_norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1)
        self.lm_head_q6k = randn(HIDDEN, VOCAB, gen=gen, device=device)
        half = HIDDEN // 2
        self.inv_freq = (THETA ** -(torch.arange(half, dtype=torch.float32) / half)).to(device)


class CudaExecutor:
    def __init__(self, w, device, variant, graphed):
        self.w, self.device, self.variant, self.graphed = w, device, variant, graphed
        self.graph_recording = False
        self.graph_recorded_kernels: list[RecordedKernel] = []
        self.decode_graph, self.decode_token_count = None, 0
        self.graph_input_buf = self.position_buf = None
        z = lambda n: torch.zeros(1, n, device=device)  # noqa: E731 - TransformerWorkspace buffers
        self.normed_hidden_buf, self.proj_buf, self.rope_buf = z(HIDDEN), z(HIDDEN), z(HIDDEN)
        self.hidden_buf = z(HIDDEN)
        self.normed_out_buf, self.logits_buf = z(HIDDEN), z(VOCAB)

    def _record(self, func, *args):
        self.graph_recorded_kernels.append(RecordedKernel(func, args))

    # ---- launch sites ----
    def rmsnorm_into(self, input, output, gamma):
        rmsnorm_kernel(output, input, gamma)
        if self.graph_recording:                           # trueno#243: record for manual graph construction
            self._record(rmsnorm_kernel, output, input, gamma)

    def hw_dp4a_q4k_gemv_into(self, weight, input, output):
        gemv_kernel(output, weight, input)
        if self.graph_recording:
            self._record(gemv_kernel, output, weight, input)

    def q6k_gemv_into(self, weight, input, output):
        gemv_kernel(output, weight, input)
        if self.variant == "fix" and self.graph_recording:   # the block c4ac6f15 adds
            self._record(gemv_kernel, output, weight, input)

    def rope_indirect_into(self, input, output, position_buf):
        rope_indirect_kernel(output, input, position_buf, self.w.inv_freq)
        if self.graph_recording:
            self._record(rope_indirect_kernel, output, input, position_buf, self.w.inv_freq)

    def residual_add_into(self, a, b, output):
        residual_add_kernel(output, a, b)
        if self.graph_recording:
            self._record(residual_add_kernel, output, a, b)

    # ---- decode ----
    def forward_workspace_captured(self):
        w = self.w
        self.rmsnorm_into(self.graph_input_buf, self.normed_hidden_buf, w.attn_norm)
        self.hw_dp4a_q4k_gemv_into(w.w_q4k, self.normed_hidden_buf, self.proj_buf)
        self.rope_indirect_into(self.proj_buf, self.rope_buf, self.position_buf)
        self.residual_add_into(self.graph_input_buf, self.rope_buf, self.hidden_buf)
        self.rmsnorm_into(self.hidden_buf, self.normed_out_buf, w.output_norm)
        self.q6k_gemv_into(w.lm_head_q6k, self.normed_out_buf, self.logits_buf)     # LM head (Q6K)

    def prepare_capture_buffers(self, x, position):
        if self.position_buf is None:
            self.position_buf = torch.tensor([position], dtype=torch.long, device=self.device)
        else:
            self.position_buf.fill_(position)
        if self.graph_input_buf is None:
            self.graph_input_buf = x.clone()
        else:
            self.graph_input_buf.copy_(x)

    def begin_graph_recording(self):
        self.graph_recorded_kernels.clear()
        self.graph_recording = True

    def end_graph_recording(self):
        """Build the graph from the recorded kernels (cuGraphAddKernelNode, a linear chain)."""
        self.graph_recording = False
        recorded = list(self.graph_recorded_kernels)

        def add_kernel_nodes():
            for record in recorded:
                record.launch()
            return self.logits_buf

        self.decode_graph, _ = capture(
            add_kernel_nodes, device=self.device, warmups=0, owner="CudaExecutor (manual decode graph)",
            static={"graph_input_buf": self.graph_input_buf, "position_buf": self.position_buf})
        self.decode_token_count = 1
        return len(recorded)

    def forward_all_layers_gpu_to_logits(self, x, position):
        """Non-graphed path: the same launch sites, no recording."""
        self.prepare_capture_buffers(x, position)
        self.forward_workspace_captured()
        return self.logits_buf.clone()

    def forward_all_layers_gpu_to_logits_graphed(self, x, position):
        if self.decode_graph is not None and self.decode_token_count > 0:
            return self.forward_graphed_replay(x, position)
        self.prepare_capture_buffers(x, position)
        # trueno#243: one eager forward with recording, then the graph from the records
        self.begin_graph_recording()
        self.forward_workspace_captured()
        self.end_graph_recording()
        return self.logits_buf.clone()        # first token: computed by the eager recording pass

    def forward_graphed_replay(self, x, position):
        self.position_buf.fill_(position)
        self.graph_input_buf.copy_(x)
        out = replay(self.decode_graph, self.logits_buf)
        self.decode_token_count += 1
        return out.clone()


def run(variant: str, device: str = "cpu"):
    w = Weights(device)

    def serve(graphed: bool):
        ex = CudaExecutor(w, device, variant, graphed)
        prompt = [3, 11, 6]
        position, last_token, outs = len(prompt) - 1, prompt[-1], []
        for _ in range(5):
            x = w.emb[last_token][None, :]
            if graphed:
                logits = ex.forward_all_layers_gpu_to_logits_graphed(x, position)
            else:
                logits = ex.forward_all_layers_gpu_to_logits(x, position)
            outs.append(logits)
            last_token, position = int(logits.argmax()), position + 1
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
