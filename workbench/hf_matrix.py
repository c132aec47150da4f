"""The architecture fidelity matrix: tiny ``transformers`` models, captured and replayed, against eager.

Each entry is an architecture built from a config (no download, seeded weights) plus how it is
called (attention mask, cache). ``run_entry`` captures one forward on static inputs, replays it on
three fresh inputs copied into those buffers and compares with eager. A capture that fails is an
answer too: its error kind is recorded, because the emulation must fail where CUDA fails, with the
same kind of error. ``gpu_record`` writes the CUDA answers (``results/gpu/hf_matrix.json``) that
``tests/test_hf_matrix.py`` checks the CPU against.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import torch
import transformers as T

from . import doctor
from .engine import CaptureError, GraphRunner, graph, new_graph, synchronize

RECORD = pathlib.Path(__file__).resolve().parent.parent / "results" / "gpu" / "hf_matrix.json"
VOCAB, SEQ, BATCH = 100, 8, 2
_LM = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64, max_position_embeddings=64)
_GQA = dict(_LM, num_key_value_heads=2)

# Architecture -> model built from config. Smallest sizes that still exercise each model's code.
_BUILDERS = {
    "bert": lambda: T.BertModel(T.BertConfig(**_LM)),
    "roberta": lambda: T.RobertaModel(T.RobertaConfig(**dict(_LM, max_position_embeddings=66))),
    "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                                               hidden_dim=64, max_position_embeddings=64)),
    "electra": lambda: T.ElectraModel(T.ElectraConfig(embedding_size=32, **_LM)),
    "llama": lambda: T.LlamaModel(T.LlamaConfig(**_GQA)),
    "qwen2": lambda: T.Qwen2Model(T.Qwen2Config(**_GQA)),
    "mistral": lambda: T.MistralModel(T.MistralConfig(**_GQA)),
    "gemma": lambda: T.GemmaModel(T.GemmaConfig(head_dim=8, **_GQA)),
    "phi": lambda: T.PhiModel(T.PhiConfig(**_LM)),
    "gpt_neox": lambda: T.GPTNeoXModel(T.GPTNeoXConfig(**_LM)),
    "gpt2": lambda: T.GPT2Model(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                             bos_token_id=0, eos_token_id=0)),
    "mamba": lambda: T.MambaModel(T.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4,
                                                num_hidden_layers=2, expand=2, conv_kernel=4)),
    "vit": lambda: T.ViTModel(T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, image_size=16, patch_size=8)),
    "t5_encoder": lambda: T.T5EncoderModel(T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                                                      num_layers=2, num_heads=4)),
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the matrix: an architecture and how it is called."""

    label: str
    arch: str
    kind: str                  # "encoder", "decoder", "ssm", "vision", "encoder-decoder encoder"
    mask: bool = False         # pass an attention mask (rows with left padding)
    cache: bool | None = None  # use_cache for decoders; None: the model takes no such argument


ENTRIES = (
    Entry("bert", "bert", "encoder", mask=True),
    Entry("roberta", "roberta", "encoder", mask=True),
    Entry("distilbert", "distilbert", "encoder", mask=True),
    Entry("electra", "electra", "encoder", mask=True),
    Entry("llama", "llama", "decoder", mask=True, cache=False),
    Entry("qwen2", "qwen2", "decoder", mask=True, cache=False),
    Entry("mistral", "mistral", "decoder", mask=True, cache=False),
    Entry("gemma", "gemma", "decoder", mask=True, cache=False),
    Entry("phi", "phi", "decoder", mask=True, cache=False),
    Entry("gpt_neox", "gpt_neox", "decoder", mask=True, cache=False),
    Entry("gpt2", "gpt2", "decoder", cache=False),
    Entry("gpt2 mask", "gpt2", "decoder", mask=True, cache=False),
    Entry("gpt2 cache", "gpt2", "decoder", cache=True),
    Entry("gpt2 mask cache", "gpt2", "decoder", mask=True, cache=True),
    Entry("mamba", "mamba", "ssm", cache=False),
    Entry("vit", "vit", "vision"),
    Entry("t5 encoder", "t5_encoder", "encoder-decoder encoder", mask=True),
)


def build(arch: str, device: str = "cpu") -> torch.nn.Module:
    """The tiny ``arch`` model in eval mode on ``device``, weights seeded."""
    if arch not in _BUILDERS:
        raise ValueError(f"arch must be one of {sorted(_BUILDERS)}, got {arch!r}")
    torch.manual_seed(0)
    return _BUILDERS[arch]().to(device).eval()


def make_inputs(entry: Entry, seed: int, device: str = "cpu", rows: int = BATCH,
                pad: int | None = None) -> dict[str, torch.Tensor]:
    """Fresh inputs of ``rows`` rows for ``entry`` from ``seed``; with a mask, row 1 (row 0 of a
    single row) is left-padded by ``pad`` tokens, ``seed % 3 + 1`` unless given (0: no padding)."""
    gen = torch.Generator().manual_seed(seed)
    if entry.arch == "vit":
        return {"pixel_values": torch.randn(rows, 3, 16, 16, generator=gen).to(device)}
    inputs = {"input_ids": torch.randint(3, VOCAB, (rows, SEQ), generator=gen).to(device)}
    if entry.mask:
        mask = torch.ones(rows, SEQ, dtype=torch.long)
        mask[min(1, rows - 1), :seed % 3 + 1 if pad is None else pad] = 0
        inputs["attention_mask"] = mask.to(device)
    return inputs


def forward(model: torch.nn.Module, entry: Entry, inputs: dict) -> torch.Tensor:
    """The model's last hidden state for ``inputs``."""
    kwargs = dict(inputs)
    if entry.cache is not None:
        kwargs["use_cache"] = entry.cache
    return model(**kwargs).last_hidden_state


def error_kind(e: BaseException) -> str:
    """The kind of a capture failure, named the same on both backends: ``host_sync`` for an op the
    stream capture refuses (``CaptureError`` on the CPU, ``operation not permitted when stream is
    capturing`` / ``cudaErrorStreamCaptureUnsupported`` on CUDA), else the exception's type."""
    text = str(e).lower()
    if isinstance(e, CaptureError) or "stream is capturing" in text or "captureunsupported" in text \
            or "capture" in text and "invalidated" in text:
        return "host_sync"
    return type(e).__name__


def run_entry(entry: Entry, device: str = "cpu", replays: int = 3) -> dict:
    """Capture ``entry`` on static inputs, replay on ``replays`` fresh inputs, compare with eager."""
    model = build(entry.arch, device)
    static = make_inputs(entry, 0, device)
    with torch.no_grad():
        forward(model, entry, static)                       # warmup, as serving stacks do
        synchronize(device)
        g = new_graph(device)
        start = time.perf_counter()
        try:
            with graph(g):
                out = forward(model, entry, static)
        except Exception as e:  # noqa: BLE001 - the failure is the answer
            return {"captured": False, "error_kind": error_kind(e), "max_abs_diff": None}
        synchronize(device)
        capture_s = time.perf_counter() - start
        diffs = []
        for seed in range(1, replays + 1):
            fresh = make_inputs(entry, seed, device)
            for name, buf in static.items():
                buf.copy_(fresh[name])
            g.replay()
            ref = forward(model, entry, fresh)
            synchronize(device)
            diffs.append((out.float() - ref.float()).abs().max().item())
    return {"captured": True, "error_kind": None, "max_abs_diff": max(diffs), "capture_s": capture_s}


def run_all(device: str = "cpu") -> dict:
    """Every entry's answer on ``device``, keyed by label."""
    return {e.label: run_entry(e, device) for e in ENTRIES}


def gpu_record(device: str = "cuda") -> dict:
    """The matrix on a GPU, for ``results/gpu/hf_matrix.json`` (JSON-serialisable)."""
    return {"entries": {e.label: {"arch": e.arch, "kind": e.kind} for e in ENTRIES},
            "results": run_all(device)}


def load_record() -> dict | None:
    """The GPU's answers from ``results/gpu/hf_matrix.json``, or None while it is not recorded."""
    if not RECORD.exists():
        return None
    record = json.loads(RECORD.read_text())
    if "results" not in record:
        raise ValueError(f"{RECORD} holds no results: {record.get('error', 'no error recorded')}")
    return record["results"]["results"]          # gpu_record's answers, per entry


def doctor_reports(device: str = "cpu", entries: tuple[Entry, ...] = ENTRIES) -> dict[str, doctor.Report]:
    """Every entry served through ``GraphRunner`` (sizes 1, 2, 4) under ``doctor.diagnose``, its
    attention masks padding a row on some steps and not on others: clean models, so any finding is
    a false alarm."""
    reports = {}
    for entry in entries:
        shapes = {name: (tuple(t.shape[1:]), t.dtype) for name, t in make_inputs(entry, 0).items()}

        def make_runner(entry=entry, shapes=shapes) -> GraphRunner:
            model = build(entry.arch, device)
            return GraphRunner(lambda **kw: forward(model, entry, kw), shapes, [1, 2, 4], device=device)

        def make_batch(n: int, step: int, entry=entry) -> dict[str, torch.Tensor]:
            return make_inputs(entry, step, device, rows=n, pad=step % 3)
        reports[entry.label] = doctor.diagnose(make_runner, make_batch)
    return reports
