"""IBM vLLM-Hook's ProbeHiddenStatesWorker runs its per-layer forward hook inside vLLM's CUDA-graph capture: the hook builds a tensor from Python data and copies it to the device, which a capturing stream refuses, so the engine fails to start in non-eager mode.

Upstream: https://github.com/IBM/vLLM-Hook/pull/7 ("fix: skip hidden-state hook work during CUDA graph capture",
IBM/vLLM-Hook, a vLLM worker plugin; merged 2026-04-15; fixes issue https://github.com/IBM/vLLM-Hook/issues/6
"ProbeHiddenStatesWorker hook is not CUDA-graph safe in non-eager mode"). Read: the PR description, the issue (vLLM
0.18, Qwen2-1.5B, non-eager mode: "The hook currently performs CUDA tensor creation/device transfer inside the forward
hook. During CUDA graph warmup/capture, this can raise: torch.AcceleratorError: CUDA error: operation not permitted when
stream is capturing. The existing safeguard only skips hook work when metadata is None ... this does not protect the
case where attention metadata exists, and the stream is currently under CUDA graph capture"), the commit fef3b6b and its
diff (two lines added to ``hs_hook`` in ``workers/probe_hidden_states_worker.py``: ``if
torch.cuda.is_current_stream_capturing(): return None`` after the ``metadata is None`` check), the pre-fix file
(``ProbeHiddenStatesWorker.load_model``, ``_install_hooks``, ``hs_hook``: flag file / run-id file checks, ``seq_lens``
from the forward context's attention metadata, ``last_indices = torch.cat([torch.tensor([0]).to(last_indices.device),
torch.cumsum(seq_lens)])``, last-token rows ``.detach().cpu()``, ``torch.save`` of the run cache), and ``hook_llm.py``
(``HookLLM``: hook dir with ``EXTRACT.flag`` and ``RUN_ID.txt``, two-pass ``_generate_with_hooks`` for a prefill-only
worker: a ``max_tokens=1`` pass with the flag set, then the full generation without it; ``_setup_hooks`` /
``_cleanup_hooks``). Reconstructed: vLLM's side (the FULL decode-graph capture with attention metadata in the forward
context, the decode padding to a captured size) from vLLM's public V1 runner design; the flag file left in the hook
directory at start-up is the "sometimes" of the issue (the hook only works while ``EXTRACT.flag`` exists, e.g. one left
by an interrupted run in a shared hook dir).
Symptom: with CUDA graphs enabled (``enforce_eager=False``) the engine sometimes dies during initialization with "CUDA
error: operation not permitted when stream is capturing"; eager mode works.
Mechanism: vLLM captures the FULL decode graphs by running the model's Python once under ``torch.cuda.graph`` with the
capture batch's attention metadata set in the forward context. Forward hooks are Python, so the hook runs inside the
capture; the metadata is not None there, so the old guard lets it through, and ``torch.tensor([0]).to(device)`` (a
pageable host-to-device copy) and ``.cpu()`` (a device-to-host sync) are issued on the capturing stream, which refuses
them. Eagerly (no capture) the same hook is legal.
Doctor: sync-in-capture, at hs_hook. A host-device copy from Python data is attempted inside the open capture, which the
capturing stream refuses; the fix returns before it whenever the stream is capturing.
Fix (upstream): ``if torch.cuda.is_current_stream_capturing(): return None`` at the top of ``hs_hook``.
Modelled: ``ProbeHiddenStatesWorker`` with ``load_model`` / ``_install_hooks`` / ``hs_hook`` / ``match_layer`` /
``LAYER_PATTERNS`` and the run cache as upstream writes them (``register_forward_hook`` on ``model.layers.<i>``, the
flag and run-id checks, the last-token gather); ``HookLLM`` with ``_generate_with_hooks`` / ``_setup_hooks`` /
``_cleanup_hooks`` / ``analyze``. Stand-ins: the hook directory is an in-memory ``HookDir`` (``os.path.exists``, the
run-id file, ``torch.save``); the model is a three-layer Qwen2-style decoder (hidden 8, one attention head over a paged
KV cache, float64); ``get_forward_context`` / ``FlashAttentionMetadata``; a ``GPUModelRunner`` that captures FULL decode
graphs at sizes [1, 2, 4] (warmup, then capture, dummy batch with ``seq_lens`` 1 and pad slots -1) and pads decode
batches with neutral rows (slot -1, ``seq_lens`` 0, the null block); the hidden-states analyzer.
Workload: the hook dir holds a flag left from an earlier run; the engine starts (decode graphs captured unless eager),
then ``HookLLM.generate`` of 3 prompts (lengths 3, 5, 2; probed layers 1 and 2) with ``max_tokens=4``: the prefill pass
with hooks, then the full generation (prefill eagerly, 3 decode steps of 3 requests padded to the size-4 graph), then
``analyze``. The bug raises at the first capture (CPU: CaptureError for the pageable copy; CUDA with torch 2.11: "Cannot
copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned", the same refused copy that
older torch let through to CUDA's "operation not permitted when stream is capturing"); the fix equals eager (max error
0: 6 probed hidden states and 4 steps of logits).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
from torch import nn

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/IBM/vLLM-Hook/pull/7"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "hs_hook"
SYMPTOM = ("with CUDA graphs enabled, ProbeHiddenStatesWorker's forward hook runs inside the decode-graph capture and "
           "copies a Python-built tensor to the device, which the capturing stream refuses: engine start-up fails with "
           "'operation not permitted when stream is capturing'")

HIDDEN, VOCAB = 8, 16
NUM_LAYERS = 3
VLLM_HOOK_LAYERS = "1;2"
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 12, 3     # block 0 is the null block
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
MAX_NUM_SEQS = 4
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
PAD_SLOT_ID = -1

_variant = "bug"

LAYER_PATTERNS = [
    re.compile(r"^model\.layers\.(\d+)$"),            # LLaMA / Qwen / Granite
    re.compile(r"^transformer\.h\.(\d+)$"),           # GPT-2
    re.compile(r"^model\.decoder\.layers\.(\d+)$"),   # OPT
]


def match_layer(name: str):
    for pat in LAYER_PATTERNS:
        m = pat.match(name)
        if m:
            return int(m.group(1))
    return None


# --- vLLM's forward context (stand-in) -----------------------------------------------------------------------------

@dataclasses.dataclass
class FlashAttentionMetadata:
    seq_lens: torch.Tensor          # [num_reqs] context length per request (device)
    positions: torch.Tensor         # [num_tokens]
    slot_mapping: torch.Tensor      # [num_tokens], PAD_SLOT_ID: no KV write
    block_table: torch.Tensor       # [num_reqs, MAX_BLOCKS_PER_REQ]
    token_req: torch.Tensor         # [num_tokens] request row of each token


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: FlashAttentionMetadata | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    global _forward_context
    prev, _forward_context = _forward_context, ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = prev


# --- the model (stand-in, Qwen2-style names) ---------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, layer_idx, kv_cache, gen, device):
        super().__init__()
        r = lambda: nn.Parameter(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4).double())  # noqa: E731
        self.qkv = nn.ParameterList([r(), r(), r()])
        self.o_proj = r()
        self.layer_idx = layer_idx
        self.kv_cache = kv_cache                        # [NUM_LAYERS, 2, NUM_BLOCKS * BLOCK_SIZE, HIDDEN]

    def forward(self, x):
        md = get_forward_context().attn_metadata
        q, k, v = (x @ w for w in self.qkv)
        cache = self.kv_cache[self.layer_idx]
        keep = (md.slot_mapping >= 0).unsqueeze(-1)
        slots = md.slot_mapping.clamp(min=0)             # pad rows write the null block back unchanged
        cache[0, slots] = torch.where(keep, k, cache[0, slots])
        cache[1, slots] = torch.where(keep, v, cache[1, slots])
        ctx = torch.arange(MAX_MODEL_LEN, device=x.device)
        rows = md.block_table[md.token_req]                                    # [T, MAX_BLOCKS]
        kv_slots = rows[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE  # [T, MAX_MODEL_LEN]
        keys, vals = cache[0, kv_slots], cache[1, kv_slots]
        visible = (ctx.unsqueeze(0) <= md.positions.unsqueeze(1)) & \
                  (ctx.unsqueeze(0) < md.seq_lens[md.token_req].unsqueeze(1))
        scores = (keys * q.unsqueeze(1)).sum(-1) * HIDDEN ** -0.5
        scores = scores.masked_fill(~visible, -1e9)
        return (torch.softmax(scores, -1).unsqueeze(-1) * vals).sum(1) @ self.o_proj


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, layer_idx, kv_cache, gen, device):
        super().__init__()
        self.self_attn = Attention(layer_idx, kv_cache, gen, device)
        self.mlp = nn.Parameter(randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.4).double())

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        h = torch.nn.functional.layer_norm(residual, (HIDDEN,))
        h = self.self_attn(h)
        residual = residual + h
        h = torch.tanh(torch.nn.functional.layer_norm(residual, (HIDDEN,)) @ self.mlp)
        return h, residual                               # vLLM decoder layers return (hidden_states, residual)


class Qwen2Model(nn.Module):
    def __init__(self, kv_cache, gen, device):
        super().__init__()
        self.embed_tokens = nn.Parameter(randn(VOCAB, HIDDEN, gen=gen, device=device).double())
        self.layers = nn.ModuleList([Qwen2DecoderLayer(i, kv_cache, gen, device) for i in range(NUM_LAYERS)])

    def forward(self, input_ids, positions):
        hidden_states, residual = self.embed_tokens[input_ids], None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states + residual


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(7)
        self.kv_cache = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS * BLOCK_SIZE, HIDDEN, device=device, dtype=torch.float64)
        self.model = Qwen2Model(self.kv_cache, gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.8).double()
        self.config = dataclasses.make_dataclass("Config", ["hidden_size", "num_hidden_layers"])(HIDDEN, NUM_LAYERS)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- the hook directory (stand-in for the files HookLLM and the worker share) -------------------------------------

class HookDir:
    def __init__(self):
        self.files: dict[str, object] = {}

    def exists(self, path):
        return path in self.files

    def read(self, path):
        return self.files[path]

    def append(self, path, text):
        self.files[path] = self.files.get(path, "") + text

    def remove(self, path):
        self.files.pop(path, None)

    def save(self, obj, path):                       # torch.save: a snapshot of the run cache
        self.files[path] = {"config": dict(obj["config"]),
                            "hs_cache": {k: {"hidden_states": [t.clone() for t in v["hidden_states"]],
                                             "layer_num": v["layer_num"]} for k, v in obj["hs_cache"].items()}}


# --- vLLM's model runner (stand-in) --------------------------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = None
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(MAX_NUM_SEQS, **i64)
        self.positions = torch.zeros(MAX_NUM_SEQS, **i64)
        self.seq_lens = torch.zeros(MAX_NUM_SEQS, **i64)
        self.slot_mapping = torch.full((MAX_NUM_SEQS,), PAD_SLOT_ID, **i64)
        self.block_table = torch.zeros(MAX_NUM_SEQS, MAX_BLOCKS_PER_REQ, **i64)
        self.token_req = torch.arange(MAX_NUM_SEQS, **i64)      # decode: token i belongs to request row i
        self.graphs = {}

    def load_model(self):
        self.model = Qwen2ForCausalLM(self.device)

    def _decode_metadata(self, bs):
        return FlashAttentionMetadata(self.seq_lens[:bs], self.positions[:bs], self.slot_mapping[:bs],
                                      self.block_table[:bs], self.token_req[:bs])

    def _decode_forward(self, bs):
        with set_forward_context(self._decode_metadata(bs)):
            return self.model(self.input_ids[:bs], self.positions[:bs])

    def capture_model(self):
        for bs in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):
            # dummy batch: one-token requests on the null block, no KV writes
            self.input_ids.zero_()
            self.positions.zero_()
            self.seq_lens.fill_(1)
            self.slot_mapping.fill_(PAD_SLOT_ID)
            self.block_table.zero_()
            g, out = capture(lambda bs=bs: self._decode_forward(bs), device=self.device, warmups=1,
                             name=f"FULL decode [{bs}]", owner="GPUModelRunner",
                             static={"input_ids": self.input_ids, "positions": self.positions,
                                     "seq_lens": self.seq_lens, "slot_mapping": self.slot_mapping,
                                     "block_table": self.block_table},
                             state={"kv_cache": self.model.kv_cache})
            self.graphs[bs] = (g, out)

    def execute_prefill(self, input_ids, positions, seq_lens, slot_mapping, block_table, token_req):
        md = FlashAttentionMetadata(seq_lens, positions, slot_mapping, block_table, token_req)
        with set_forward_context(md):                    # prefill / mixed batches run eagerly
            hidden = self.model(input_ids, positions)
        last = torch.cumsum(seq_lens, 0) - 1
        return self.model.compute_logits(hidden[last])

    def execute_decode(self, input_ids, positions, seq_lens, slot_mapping, block_table):
        n = input_ids.shape[0]
        if self.enforce_eager or n > max(CUDAGRAPH_CAPTURE_SIZES):
            md = FlashAttentionMetadata(seq_lens, positions, slot_mapping, block_table,
                                        torch.arange(n, device=self.device))
            with set_forward_context(md):
                return self.model.compute_logits(self.model(input_ids, positions))
        bs = next(s for s in sorted(CUDAGRAPH_CAPTURE_SIZES) if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(seq_lens)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.block_table[:n].copy_(block_table)
        self.input_ids[n:bs].zero_()                     # padded rows: neutral
        self.positions[n:bs].zero_()
        self.seq_lens[n:bs].zero_()
        self.slot_mapping[n:bs].fill_(PAD_SLOT_ID)
        self.block_table[n:bs].zero_()
        g, out = self.graphs[bs]
        hidden = replay(g, out, real=n, size=bs)
        return self.model.compute_logits(hidden[:n])


# --- vllm_hook_plugins/workers/probe_hidden_states_worker.py --------------------------------------------------------

class V1Worker:
    def __init__(self, device, enforce_eager, hook_dir):
        self.model_runner = GPUModelRunner(device, enforce_eager)
        self.hook_files = hook_dir                      # the hook directory (stand-in for the file system)

    def load_model(self):
        self.model_runner.load_model()

    def compile_or_warm_up_model(self):
        if not self.model_runner.enforce_eager:
            self.model_runner.capture_model()


class ProbeHiddenStatesWorker(V1Worker):

    def load_model(self, *args, **kwargs):
        r = super().load_model(*args, **kwargs)
        self._install_hooks()
        return r

    def _install_hooks(self):
        model = getattr(self.model_runner, "model", None)
        if model is None:
            return
        self.hook_flag = "EXTRACT.flag"                 # os.environ["VLLM_HOOK_FLAG"]
        self.hook_dir = "hook_dir"                      # os.environ["VLLM_HOOK_DIR"]
        self.run_id_file = "RUN_ID.txt"                 # os.environ["VLLM_RUN_ID"]
        self.hs_mode = "last_token"
        tp_rank = 0
        self.target_layers = self._parse_target_layers()
        self._run_cache = {}
        cfg = model.config
        self._conf = {"hidden_size": int(cfg.hidden_size), "num_layers": int(cfg.num_hidden_layers)}
        files = self.hook_files

        def hs_hook(output, module_name, layer_num):
            if not files.exists(self.hook_flag):
                return None

            if files.exists(self.run_id_file):
                run_id = files.read(self.run_id_file).strip().split("\n")[-1]
            else:
                raise Exception("run_id not found.")

            ctx = get_forward_context()
            metadata = getattr(ctx, "attn_metadata", None)

            # Warmup or non-attention passes: nothing to do
            if metadata is None:
                return
            if _variant == "fix" and torch.cuda.is_current_stream_capturing():   # the engine answers it on the CPU too
                return None

            seq_lens = getattr(metadata, "seq_lens", None)
            if seq_lens is None:
                return

            last_indices = torch.cumsum(seq_lens, dim=0)
            bs = len(last_indices)
            last_indices = torch.cat([torch.tensor([0]).to(last_indices.device), last_indices])

            hidden = output[0] if isinstance(output, tuple) else output

            cache = self._run_cache.get(run_id)
            if cache is None:
                cache = {"config": self._conf, "hs_cache": {}}
                self._run_cache[run_id] = cache
            if module_name not in cache["hs_cache"]:
                batch_hs = []
            else:
                batch_hs = cache["hs_cache"][module_name]["hidden_states"]

            if self.hs_mode == "last_token":
                batch_hs.extend([hidden[last_indices[i + 1] - 1].detach().cpu() for i in range(bs)])
            else:
                raise NotImplementedError(f"Unknown hs_mode: {self.hs_mode}")

            cache["hs_cache"][module_name] = {"hidden_states": batch_hs, "layer_num": layer_num}
            files.save(cache, f"{self.hook_dir}/{run_id}/tp_rank_{tp_rank}/hidden_states.pt")

        self._hooks = []
        for name, module in model.named_modules():
            layer_num = match_layer(name)
            if layer_num is None or layer_num not in self.target_layers:
                continue
            self._hooks.append(module.register_forward_hook(
                lambda m, i, o, n=name, ln=layer_num: hs_hook(o, n, ln)))

    def _parse_target_layers(self):
        return {int(p.strip()) for p in VLLM_HOOK_LAYERS.split(";") if p.strip()}


# --- vLLM's LLM engine (stand-in) and vllm_hook_plugins/hook_llm.py ------------------------------------------------

class LLM:
    def __init__(self, device, enforce_eager, hook_dir):
        self.device = device
        self.worker = ProbeHiddenStatesWorker(device, enforce_eager, hook_dir)
        self.worker.load_model()
        self.worker.compile_or_warm_up_model()          # engine start-up: decode graphs captured here
        self.free_blocks = list(range(NUM_BLOCKS - 1, 0, -1))

    def generate(self, prompts, max_tokens):
        runner, dev = self.worker.model_runner, self.device
        i64 = dict(dtype=torch.int64, device=dev)
        tables = []
        for p in prompts:
            need = -(-(len(p) + max_tokens) // BLOCK_SIZE)
            tables.append([self.free_blocks.pop() for _ in range(need)] + [0] * (MAX_BLOCKS_PER_REQ - need))
        block_table = torch.tensor(tables, **i64)
        slot = lambda r, pos: tables[r][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # noqa: E731
        ids = [t for p in prompts for t in p]
        pos = [i for p in prompts for i in range(len(p))]
        req = [r for r, p in enumerate(prompts) for _ in p]
        logits = runner.execute_prefill(torch.tensor(ids, **i64), torch.tensor(pos, **i64),
                                        torch.tensor([len(p) for p in prompts], **i64),
                                        torch.tensor([slot(r, q) for r, q in zip(req, pos)], **i64),
                                        block_table, torch.tensor(req, **i64))
        outs, lens = [logits], [len(p) for p in prompts]
        tokens = logits.argmax(-1)
        for _ in range(max_tokens - 1):
            positions = torch.tensor(lens, **i64)
            seq_lens = positions + 1
            slots = torch.tensor([slot(r, q) for r, q in enumerate(lens)], **i64)
            logits = runner.execute_decode(tokens, positions, seq_lens, slots, block_table)
            outs.append(logits)
            tokens = logits.argmax(-1)
            lens = [n + 1 for n in lens]
        for row in tables:
            self.free_blocks.extend(b for b in row if b)
        return outs


class HookLLM:
    hooks_on = (True, False)                            # probe_hidden_states: hooks on prefill only

    def __init__(self, device, enforce_eager, hook_dir):
        self._hook_dir = hook_dir
        self._hook_flag = "EXTRACT.flag"
        self._run_id_file = "RUN_ID.txt"
        self.llm = LLM(device, enforce_eager, hook_dir)

    def generate(self, prompts, max_tokens, cleanup=True):
        return self._generate_with_hooks(prompts, max_tokens, cleanup, *self.hooks_on)

    def _generate_with_hooks(self, prompts, max_tokens, cleanup, hooks_on_prefill, hooks_on_generate):
        # Two-pass: prefill (max_tokens=1) then full generation
        if hooks_on_prefill:
            self._setup_hooks(cleanup)
        self.llm.generate(prompts, max_tokens=1)
        if hooks_on_prefill:
            self._cleanup_hooks()
        if hooks_on_generate:
            self._setup_hooks(cleanup)
        output = self.llm.generate(prompts, max_tokens)
        if hooks_on_generate:
            self._cleanup_hooks()
        return output

    def analyze(self):
        run_id = self._hook_dir.read(self._run_id_file).strip().split("\n")[-1]
        saved = self._hook_dir.read(f"hook_dir/{run_id}/tp_rank_0/hidden_states.pt")
        return [t for name in sorted(saved["hs_cache"]) for t in saved["hs_cache"][name]["hidden_states"]]

    def _setup_hooks(self, cleanup):
        if cleanup:
            self._hook_dir.remove(self._run_id_file)
        self._run_ids = getattr(self, "_run_ids", 0) + 1
        self._hook_dir.append(self._run_id_file, f"run-{self._run_ids}\n")
        self._hook_dir.append(self._hook_flag, "")

    def _cleanup_hooks(self):
        self._hook_dir.remove(self._hook_flag)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [[3, 7, 1], [2, 9, 4, 4, 11], [5, 6]]

    def serve(enforce_eager):
        hook_dir = HookDir()
        hook_dir.append("RUN_ID.txt", "run-0\n")        # left by an earlier, interrupted analysis run
        hook_dir.append("EXTRACT.flag", "")
        llm = HookLLM(device, enforce_eager, hook_dir)
        logits = llm.generate(prompts, max_tokens=4)
        return [torch.stack(llm.analyze())] + [t.clone() for t in logits]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
