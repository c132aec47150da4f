"""MiniMax Music 3's AR decode loop omits ``decode_buffers``: each block's captured graph keeps reading the freed first clone of x.

Upstream: https://github.com/Comfy-Org/ComfyUI/pull/16428 ("Fix MiniMax Music 3 producing noise with CUDA graphs
enabled.", merged; opened 2026-09-20). Reports: #16002 (second report), #16222. The graph machinery comes from #15570,
and ``init_decode_buffers`` from #15623 (which fixed the same hazard for ``generate()`` and YuE2).
Symptom: no exception. With the Comfy compiler's CUDA graphs on, the AR text encoder emits garbage codes, the decoded
audio is NaN and SaveAudio writes a constant -32768. It is deterministic with ``--disable-cuda-malloc``, where the
native allocator hands the freed block on at once. Correct with ``--disable-cuda-graphs``, and bit-identical to that
after the fix.
Mechanism: ``Llama2_.forward`` (comfy/text_encoders/llama.py), on a fixed-KV decode step with
``graph_dynamic_vbar_blocks``, sets ``enable_graph`` and, when the caller passes no ``decode_buffers``, makes
``x = x.clone()``, a new allocation every step. ``freqs_cis`` is also recomputed into a new tensor every step. Each
block's ``core()`` reads ``x`` and ``freqs_cis`` and writes the block output back with ``x.copy_(output)``.
``comfy.model_prefetch.prefetch_queue_pop`` runs ``core()`` eagerly the first time (``GRAPH_WARMED_MODULES``). The
next time it captures ``core()`` into a per-block ``torch.cuda.CUDAGraph`` (``module._comfy_graph``) and replays it at
once. On every later step it only replays. The captured kernels keep the capture step's clone and rotary tensor. Both
were freed when that step's forward returned and are later handed to other tensors. So every replay reads and writes
released memory, and the live clone of the current step is never written. The final norm and lm_head see the
un-transformed embedding of the token, and the codes are garbage. ``BaseGenerate.generate`` and YuE2 pass persistent
``decode_buffers``. ``MiniMaxMusic3AR`` (comfy/ldm/minimax_music/ar.py), which runs its own decode loop, did not.
Doctor: dangling-reference, at generate (the MiniMax Music 3 AR decode loop calls the decoder without persistent
``decode_buffers``. Every step's hidden clone and rotary tensor are released at the end of the step, while the block
graphs captured on the second decode step keep reading and writing the first of them on every replay).
Fix (upstream): the loop builds ``decode_buffers = self.model.init_decode_buffers(batch, device, dtype)``, gated like
``generate()`` (``graph_dynamic_vbar_blocks and malloc_graph_enabled(device) and not args.disable_cuda_graphs``), and
passes ``decode_buffers=`` into every decode forward. ``forward`` then copies x into ``hidden_buffer`` and the rotary
matrix into ``rotary_buffer``, which keep their addresses across replays.
Modelled: a 2-layer Qwen3-style ``Llama2_`` (RMSNorm, RoPE, one KV head, SiLU MLP) with ``FixedKV`` caches (device-side
``position``/``seqlen``, and decode attention over the full capacity with a length mask). CFG is a cond/uncond batch
of 2 with a logits blend and greedy argmax instead of the sampler. ``prefetch_queue_pop`` keeps only the
warm/capture/replay ladder (no VBAR faulting, signatures, prefetch streams or malloc graph; the signature always
hits). The method name ``MiniMaxMusic3AR.generate`` is assumed: the ``ar.py`` diff was not read. The loop keeps each
frame's hidden state, as Music 3 does for conditioning, so later allocations drift over the freed blocks. CPU graphs
use ``on_freed="reuse"``: a released block keeps its bytes until it is handed on. On CUDA the replays read whatever
the allocator put there; the replay step's live clone is never written, wherever it lands.
"""

import torch

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/Comfy-Org/ComfyUI/pull/16428"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "generate"
SYMPTOM = "per-block decode graphs replay on the freed first-step clone of x; the AR emits garbage codes (noise audio)"

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, LAYERS, VOCAB, INTER = 16, 8, 2, 1, 2, 24, 32
PREFIX, FRAMES, CFG = 5, 7, 2.5
ROPE_THETA, EPS = 10000.0, 1e-6


class Args:
    disable_cuda_graphs = False


# --- comfy.text_encoders.llama ------------------------------------------------------------------

class FixedKV:
    def __init__(self, key, value, index, position, seqlen):
        self.key, self.value, self.index, self.position, self.seqlen = key, value, index, position, seqlen

    def prepare(self, num_tokens):
        self.position.copy_(self.seqlen)
        self.seqlen.add_(num_tokens)

    def advance(self, num_tokens):
        self.index += num_tokens

    def decode(self, xq, xk, xv):
        # CUDA-graphable: device-side write position and cache length
        seq = xq.shape[2]
        slots = self.position + torch.arange(seq, device=xq.device)
        self.key.index_copy_(2, slots, xk)
        self.value.index_copy_(2, slots, xv)
        cap = self.key.shape[2]
        query_pos = slots.view(seq, 1)
        visible = torch.arange(cap, device=xq.device).view(1, cap) <= query_pos
        bias = torch.zeros(seq, cap, device=xq.device).masked_fill(~visible, -1e9)
        k = self.key.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = self.value.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = (xq @ k.transpose(-1, -2)) * HEAD_DIM ** -0.5 + bias
        return torch.softmax(scores, dim=-1) @ v


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def precompute_freqs_cis(head_dim, position_ids, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = position_ids[0].to(torch.float32).view(-1, 1) * inv.view(1, -1)          # [seq, hd/2]
    return torch.cos(ang), torch.sin(ang)


def rope_matrix(freqs_cis):
    cos, sin = freqs_cis
    return torch.stack((cos, sin), dim=0)                                           # [2, seq, hd/2]


def apply_rope(t, rot):
    cos, sin = rot[0], rot[1]
    t1, t2 = t[..., 0::2], t[..., 1::2]
    return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)


class TransformerBlock:
    def __init__(self, gen, device):
        def w(*s, scale=0.3):
            return (torch.randn(*s, generator=gen) * scale).to(device)
        self.in_norm, self.post_norm = (1 + w(HIDDEN, scale=0.1)), (1 + w(HIDDEN, scale=0.1))
        self.wq, self.wk, self.wv = w(HIDDEN, HEADS * HEAD_DIM), w(HIDDEN, KV_HEADS * HEAD_DIM), w(HIDDEN, KV_HEADS * HEAD_DIM)
        self.wo = w(HEADS * HEAD_DIM, HIDDEN)
        self.gate, self.up, self.down = w(HIDDEN, INTER), w(HIDDEN, INTER), w(INTER, HIDDEN)

    def __call__(self, x, freqs_cis, past_key_value):
        b, s, _ = x.shape
        h = rms_norm(x, self.in_norm)
        q = (h @ self.wq).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = (h @ self.wk).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (h @ self.wv).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        attn = past_key_value.decode(q, k, v).transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM)
        x = x + attn @ self.wo
        h = rms_norm(x, self.post_norm)
        return x + (torch.nn.functional.silu(h @ self.gate) * (h @ self.up)) @ self.down, past_key_value


class Llama2_:
    graph_dynamic_vbar_blocks = True          # Qwen3VL/Music3 configs: graph_dynamic_vbar_blocks, fixed_kv

    def __init__(self, gen, device):
        self.embed_tokens = (torch.randn(VOCAB, HIDDEN, generator=gen)).to(device)
        self.layers = [TransformerBlock(gen, device) for _ in range(LAYERS)]
        self.norm = (1 + torch.randn(HIDDEN, generator=gen) * 0.1).to(device)
        self.lm_head = (torch.randn(HIDDEN, VOCAB, generator=gen) * 0.5).to(device)

    def init_kv_cache(self, batch, capacity, device):
        caches = []
        for _ in range(LAYERS):
            key = torch.zeros((batch, KV_HEADS, capacity, HEAD_DIM), device=device)
            pos = torch.zeros((1,), device=device, dtype=torch.int64)
            seqlen = torch.zeros((1,), device=device, dtype=torch.int64)
            caches.append(FixedKV(key, torch.zeros_like(key), 0, pos, seqlen))
        return caches

    def init_decode_buffers(self, batch, device, dtype):
        hidden = torch.empty((batch, 1, HIDDEN), device=device, dtype=dtype)
        positions = torch.zeros((1, 1), device=device, dtype=torch.int64)
        return hidden, rope_matrix(self.compute_freqs_cis(positions, device))

    def compute_freqs_cis(self, position_ids, device):
        return precompute_freqs_cis(HEAD_DIM, position_ids, ROPE_THETA, device)

    def forward(self, x, position_ids, past_key_values, graphs, decode_buffers=None):
        x = self.embed_tokens[x]
        seq_len = x.shape[1]
        past_len = past_key_values[0].index
        fixed_kv_decode = past_len > 0 and seq_len == 1
        freqs_cis = rope_matrix(self.compute_freqs_cis(position_ids, x.device))

        enable_graph = self.graph_dynamic_vbar_blocks and fixed_kv_decode
        if enable_graph:
            if decode_buffers is None:
                x = x.clone()                                   # a new allocation on every decode step
            else:
                hidden_buffer, rotary_buffer = decode_buffers
                hidden_buffer.copy_(x)
                x = hidden_buffer
                rotary_buffer.copy_(freqs_cis)
                freqs_cis = rotary_buffer

        for i, layer in enumerate(self.layers):
            past_kv = past_key_values[i]
            past_kv.prepare(seq_len)

            def core(layer=layer, past_kv=past_kv):
                nonlocal x
                output, _ = layer(x=x, freqs_cis=freqs_cis, past_key_value=past_kv)
                if enable_graph:
                    x.copy_(output)
                else:
                    x = output
                return x

            graphs.prefetch_queue_pop(layer, core=core, enable_graph=enable_graph,
                                      inputs={"x": x, "freqs_cis": freqs_cis}, kv=past_kv)
            past_kv.advance(seq_len)

        x = rms_norm(x, self.norm)
        return x, None, past_key_values


# --- comfy.model_prefetch (the per-block warm / capture / replay ladder) -------------------------

class ModelPrefetch:
    def __init__(self, device):
        self.device = device
        self.GRAPH_WARMED_MODULES = set()
        self.graphs = {}                                         # id(module) -> module._comfy_graph

    def prefetch_queue_pop(self, module, core, enable_graph, inputs, kv):
        enable_graph = enable_graph and not Args.disable_cuda_graphs
        graph = self.graphs.get(id(module)) if enable_graph else None
        if graph is not None:                                    # vbar signature compare: hit
            replay(graph["graph"], graph["out"])
            return
        if enable_graph and id(module) in self.GRAPH_WARMED_MODULES:
            g, out = capture(core, device=self.device, warmups=0, name=f"block {len(self.graphs)}",
                             on_freed="reuse", owner="comfy.model_prefetch.prefetch_queue_pop",
                             static=inputs, state={"key": kv.key, "value": kv.value})
            replay(g, out)                                       # graph.replay() right after capture
            self.graphs[id(module)] = {"graph": g, "out": out}
            return
        core()
        if enable_graph:
            self.GRAPH_WARMED_MODULES.add(id(module))


# --- comfy.ldm.minimax_music.ar -----------------------------------------------------------------

class MiniMaxMusic3AR:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant

    def generate(self, prefixes, frames):
        device, dtype = self.device, torch.float32
        batch = len(prefixes)                                    # cond / uncond (CFG)
        cache = self.model.init_kv_cache(batch, PREFIX + frames + 1, device)
        graphs = ModelPrefetch(device)
        ids = torch.tensor(prefixes, device=device)
        positions = torch.arange(PREFIX, device=device).view(1, PREFIX)
        hidden, _, cache = self.model.forward(ids, positions, cache, graphs)           # prefill (no graphs)
        logits = torch.empty((batch, VOCAB), device=device)
        logits.copy_(hidden[:, -1] @ self.model.lm_head)
        positions = torch.full((1, 1), PREFIX, device=device, dtype=torch.int64)
        decode_tokens = torch.empty((batch, 1), dtype=torch.long, device=device)

        decode_buffers = None
        if self.variant == "fix" and self.model.graph_dynamic_vbar_blocks and not Args.disable_cuda_graphs:
            decode_buffers = self.model.init_decode_buffers(batch, device, dtype)

        outs, frame_hidden = [], []
        for step in range(frames):
            guided = logits[1] + CFG * (logits[0] - logits[1])
            outs.append(guided.clone())
            decode_tokens.copy_(guided.argmax(-1).view(1, 1).expand(batch, 1))
            output = self.model.forward(decode_tokens, positions, cache, graphs, decode_buffers=decode_buffers)
            frame_hidden.append(output[0][:, -1])                # per-frame hidden state kept for conditioning
            logits.copy_(output[0][:, -1] @ self.model.lm_head)
            cache = output[2]
            del output
            positions.add_(1)
        return outs + [torch.stack(frame_hidden)]


def run(variant: str, device: str = "cpu"):
    gen = generator(16428)
    model = Llama2_(gen, device)
    prompt = torch.randint(0, VOCAB, (PREFIX,), generator=gen).tolist()
    prefixes = [prompt, [0] * (PREFIX - 1) + [prompt[-1]]]

    def serve(graphed: bool):
        Args.disable_cuda_graphs = not graphed
        try:
            return MiniMaxMusic3AR(model, device, variant).generate(prefixes, FRAMES)
        finally:
            Args.disable_cuda_graphs = False

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
