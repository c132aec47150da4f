"""An M=1 decode capture after an M=4 batched request binds the 4 x vocab ``logits_buf`` the batched path left.

Upstream: https://github.com/paiml/realizar/commit/d481827aa3c12259aeeb71da530a22c2d422f057 ("fix: PMAT-088 logits
buffer size mismatch after M=4->M=1 transition (Refs PMAT-088)"), a direct commit on main (no PR).
Symptom: an M=1 request served after a batched M=4 decode fails with "Length mismatch: host 151936 vs device
607744" (Qwen vocab 151936 = host logits; 4 x 151936 = the device buffer).
Mechanism: the batched graphed decode (``forward_batched_to_token_ids_graphed``) calls
``init_batched_graph_buffers(m)``, which reallocates ``workspace.logits_buf`` to ``m * vocab_size`` for its graph.
The M=1 graphed decode (``try_first_token_graph_capture``) prepares its capture buffers in
``prepare_capture_buffers``, which allocated ``logits_buf`` only ``if self.workspace.logits_buf.is_none()``: after
the batched request the buffer exists, with 4 x vocab elements, so the M=1 decode graph is captured with the LM-head
GEMV writing the first ``vocab`` elements of the batched buffer, and the first token's
``logits_buf.copy_to_host(logits)`` (host length vocab) fails trueno's length check. The eager M=1 path
(``forward_all_layers_gpu_to_logits``) writes its logits into a buffer of its own and is unaffected. Modelled with
a one-layer decode (RMSNorm, a position term, the LM head); ``GpuBuffer::copy_to_host`` is ``copy_to_host``.
Doctor: undersized-buffer, at prepare_capture_buffers (the capture binds a static logits buffer whose size does not
match the M=1 logits it must carry; only its existence is checked).
Fix (upstream): (1) ``prepare_capture_buffers`` (and the same block in ``forward_graphed_decode.rs``) reallocates
``logits_buf`` when ``b.len() != vocab_size``; (2) ``init_batched_graph_buffers`` calls ``clear_decode_graph()`` after
reallocating ``logits_buf`` (an M=1 graph captured the old buffer); (3) ``batched_cleanup`` calls
``clear_decode_graph()`` unconditionally. In this workload (as in the reported one) (1) is the one that matters:
the M=1 graph is already cleared at batched setup (PMAT-044) and after every prefill (PMAT-085).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/paiml/realizar/commit/d481827aa3c12259aeeb71da530a22c2d422f057"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "prepare_capture_buffers"
SYMPTOM = "M=1 decode after a batched M=4 request: 'Length mismatch: host 8 vs device 32'"

VOCAB, HIDDEN, BATCH, EPS = 8, 4, 4, 1e-6


class GpuError(RuntimeError):
    pass


def copy_to_host(buf, host):
    """trueno ``GpuBuffer::copy_to_host``: the host slice must have the buffer's length."""
    if buf.numel() != host.numel():
        raise GpuError(f"Length mismatch: host {host.numel()} vs device {buf.numel()}")
    host.copy_(buf)
    return host


class Weights:
    def __init__(self, device):
        gen = generator(88)
        self.emb = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.pos_w = randn(HIDDEN, gen=gen, device=device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device)


class TransformerWorkspace:
    def __init__(self):
        self.normed_hidden_buf = None
        self.logits_buf = None


class CudaExecutor:
    def __init__(self, w, device, variant, graphed):
        self.w, self.device, self.variant, self.graphed = w, device, variant, graphed
        self.workspace = TransformerWorkspace()
        self.decode_graph, self.decode_token_count = None, 0
        self.graph_input_buf = self.position_buf = None
        self.batched_decode_graphs = {}
        self.batched_graph_batch_size = 0
        self.batched_graph_input_buf = self.batched_graph_positions_buf = self.batched_normed_buf = None

    def clear_decode_graph(self):
        self.decode_graph, self.decode_token_count = None, 0
        self.graph_input_buf = self.position_buf = None

    # ---- kernels (they write the output buffers they are given, as the PTX kernels do) ----
    def rmsnorm_into(self, x, positions, output):
        h = x + torch.sin(positions.to(x.dtype))[:, None] * self.w.pos_w
        output.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS))

    def q6k_gemv_into(self, input, output, m):
        """LM head: writes ``m * VOCAB`` elements at ``output`` (the kernel's n)."""
        output[:m * VOCAB].copy_((input @ self.w.lm_head).reshape(-1))

    def forward_layers(self, x, positions, normed, logits, m):
        self.rmsnorm_into(x, positions, normed)
        self.q6k_gemv_into(normed, logits, m)

    # ---- M=1 decode ----
    def forward_all_layers_gpu_to_logits(self, x, position, logits):
        """Non-graphed path: its own buffers; the result is written into the host ``logits``."""
        normed, out = torch.empty(1, HIDDEN, device=self.device), torch.empty(VOCAB, device=self.device)
        self.forward_layers(x, torch.full((1,), position, device=self.device), normed, out, 1)
        return copy_to_host(out, logits)

    def prepare_capture_buffers(self, x, position):
        if self.position_buf is None:
            self.position_buf = torch.tensor([position], dtype=torch.long, device=self.device)
        else:
            self.position_buf.fill_(position)
        if self.graph_input_buf is None:
            self.graph_input_buf = x.clone()
        else:
            self.graph_input_buf.copy_(x)
        if self.workspace.normed_hidden_buf is None:
            self.workspace.normed_hidden_buf = torch.empty(1, HIDDEN, device=self.device)
        if self.variant == "fix":
            # PMAT-088: batched decode may have resized logits_buf to M*vocab_size: check the size
            needs_logits = self.workspace.logits_buf is None or self.workspace.logits_buf.numel() != VOCAB
        else:
            needs_logits = self.workspace.logits_buf is None
        if needs_logits:
            self.workspace.logits_buf = torch.empty(VOCAB, device=self.device)

    def forward_workspace_captured(self):
        self.forward_layers(self.graph_input_buf, self.position_buf, self.workspace.normed_hidden_buf,
                            self.workspace.logits_buf, 1)
        return self.workspace.logits_buf

    def forward_all_layers_gpu_to_logits_graphed(self, x, position, logits):
        if self.decode_graph is not None and self.decode_token_count > 0:
            return self.forward_graphed_replay(x, position, logits)
        self.prepare_capture_buffers(x, position)
        self.decode_graph, _ = capture(
            self.forward_workspace_captured, device=self.device, warmups=0, owner="CudaExecutor (M=1 decode graph)",
            static={"graph_input_buf": self.graph_input_buf, "position_buf": self.position_buf})
        self.decode_token_count = 1
        replay(self.decode_graph, self.workspace.logits_buf)        # launch once for the first token
        return copy_to_host(self.workspace.logits_buf, logits)

    def forward_graphed_replay(self, x, position, logits):
        self.position_buf.fill_(position)
        self.graph_input_buf.copy_(x)
        replay(self.decode_graph, self.workspace.logits_buf)
        self.decode_token_count += 1
        return copy_to_host(self.workspace.logits_buf, logits)

    # ---- batched (M=4) decode ----
    def init_batched_graph_buffers(self, m):
        if self.batched_graph_input_buf is None or self.batched_graph_input_buf.shape[0] != m:
            self.batched_graph_input_buf = torch.empty(m, HIDDEN, device=self.device)
        if self.batched_graph_positions_buf is None or self.batched_graph_positions_buf.numel() != m:
            self.batched_graph_positions_buf = torch.empty(m, dtype=torch.long, device=self.device)
        if self.batched_normed_buf is None or self.batched_normed_buf.shape[0] != m:
            self.batched_normed_buf = torch.empty(m, HIDDEN, device=self.device)
        logits_size = m * VOCAB
        if self.workspace.logits_buf is None or self.workspace.logits_buf.numel() != logits_size:
            self.workspace.logits_buf = torch.empty(logits_size, device=self.device)
            if self.variant == "fix":
                # PMAT-088: logits buffer reallocation invalidates the M=1 decode graph
                self.clear_decode_graph()

    def forward_batched_to_token_ids(self, xs, positions, logits):
        m = xs.shape[0]
        normed, out = torch.empty(m, HIDDEN, device=self.device), torch.empty(m * VOCAB, device=self.device)
        self.forward_layers(xs, positions, normed, out, m)
        return copy_to_host(out, logits)

    def forward_batched_to_token_ids_graphed(self, xs, positions, logits):
        m = xs.shape[0]
        if m not in self.batched_decode_graphs or self.batched_graph_batch_size != m:
            self.init_batched_graph_buffers(m)
            self.batched_graph_input_buf.copy_(xs)
            self.batched_graph_positions_buf.copy_(positions)
            ws = self.workspace
            self.batched_decode_graphs[m], _ = capture(
                lambda: self.forward_layers(self.batched_graph_input_buf, self.batched_graph_positions_buf,
                                            self.batched_normed_buf, ws.logits_buf, m),
                device=self.device, warmups=0, owner="CudaExecutor (batched decode graph)",
                static={"batched_graph_input_buf": self.batched_graph_input_buf,
                        "batched_graph_positions_buf": self.batched_graph_positions_buf})
            self.batched_graph_batch_size = m
        self.batched_graph_input_buf.copy_(xs)
        self.batched_graph_positions_buf.copy_(positions)
        replay(self.batched_decode_graphs[m], self.workspace.logits_buf)
        return copy_to_host(self.workspace.logits_buf, logits)


class OwnedQuantizedModelCuda:
    def __init__(self, w, device, variant, graphed):
        self.w, self.device, self.variant, self.graphed = w, device, variant, graphed
        self.executor = CudaExecutor(w, device, variant, graphed)

    def generate_gpu_resident_streaming(self, prompt, max_tokens):
        # (run_prefill: the prompt's K/V are left out of this model)
        # PMAT-085 / CORRECTNESS-013: clear the decode graph before the decode loop
        self.executor.clear_decode_graph()
        position, last_token, outs = len(prompt), prompt[-1], []
        for _ in range(max_tokens):
            logits = torch.empty(VOCAB)                      # the host Vec<f32>
            x = self.w.emb[last_token][None, :]
            if self.graphed:
                self.executor.forward_all_layers_gpu_to_logits_graphed(x, position, logits)
            else:
                self.executor.forward_all_layers_gpu_to_logits(x, position, logits)
            outs.append(logits.clone())
            last_token, position = int(logits.argmax()), position + 1
        return outs

    def generate_batched_streaming(self, prompts, max_tokens):
        # batched_setup_and_prefill: PMAT-044, clear the M=1 decode graph from prior requests
        self.executor.clear_decode_graph()
        last = [p[-1] for p in prompts]
        positions = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        outs = []
        for _ in range(max_tokens):
            logits = torch.empty(len(prompts) * VOCAB)
            xs = self.w.emb[torch.tensor(last, device=self.device)]
            if self.graphed:
                self.executor.forward_batched_to_token_ids_graphed(xs, positions, logits)
            else:
                self.executor.forward_batched_to_token_ids(xs, positions, logits)
            outs.append(logits.clone())
            last = logits.view(len(prompts), VOCAB).argmax(-1).tolist()
            positions = positions + 1
        self.batched_cleanup()
        return outs

    def batched_cleanup(self):
        if self.variant == "fix":
            # PMAT-088: batched decode may have resized logits_buf: clear the M=1 decode graph
            self.executor.clear_decode_graph()


def run(variant: str, device: str = "cpu"):
    w = Weights(device)

    def serve(graphed: bool):
        model = OwnedQuantizedModelCuda(w, device, variant, graphed)
        outs = model.generate_gpu_resident_streaming([2, 5], max_tokens=2)                   # M=1
        outs += model.generate_batched_streaming([[1], [3, 4], [6], [7, 0]], max_tokens=2)   # M=4
        outs += model.generate_gpu_resident_streaming([4, 1, 3], max_tokens=2)                # M=1 again
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
