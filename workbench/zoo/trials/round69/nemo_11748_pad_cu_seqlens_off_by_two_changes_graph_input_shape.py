"""Packed SFT pads ``cu_seqlens`` "to a constant shape" two entries short: a fuller pack no longer fits the layer graphs.

Upstream: https://github.com/NVIDIA/NeMo/pull/11748 ("Enable packed seqs for validation", commit c7710426e1,
merged 2025-01-08; its commit bullets include "fix packing pad for val" and "fix padding").
Symptom: packed-sequence SFT with Megatron-Core CUDA graphs (``enable_cuda_graph``, which needs
``PackedSequenceSpecs.pad_cu_seqlens=True``) runs the first micro-batches, then stops at the first pack holding more
sequences than the recorded one with ``AssertionError: Tried replaying a cudagraph with different arguments than
what if was created with!``. The same run without CUDA graphs trains. (Inferred from the diff; the PR text is only
the template.)
Mechanism: ``pad_cu_seqlens`` exists so that every micro-batch hands the graphed ``TransformerLayer`` a
``PackedSeqParams.cu_seqlens_q/kv`` of one shape: Megatron's ``CudaGraphManager`` records the first micro-batch,
``create_cudagraphs()`` captures each layer at those input shapes, and ``_CudaGraphRunner.replay_graph_capture``
only replays inputs that ``matches_graph_inputs`` (same tensor shapes, same non-tensor values). In
``GPTSFTPackedDataset.collate_fn`` (nemo/collections/nlp/data/language_modeling/megatron/gpt_sft_dataset.py) a pack
of ``n`` sequences gives ``cu_seqlens = [0, c1, .., cn]`` plus ``max_length`` when the pack does not fill it:
``n + 1`` or ``n + 2`` entries. The old pad count ``max_samples_per_bin - len(cu_seqlens[-1])`` pads to
``max_samples_per_bin`` entries, which packs with (nearly) ``max_samples_per_bin`` sequences already exceed:
those (negative ``pad_num``: nothing padded) keep ``max_samples_per_bin + 1`` or ``+ 2`` entries, and
``get_packed_seq_params`` cuts the collate's ``-1`` tail at ``cu_seqlens_argmin``, so the layers get
``cu_seqlens`` of 4, 5 or 6 entries here depending on the pack. The graph recorded on a 2-sequence pack (4
entries) cannot take a 3-sequence pack's 5 entries. Eager TE attention takes any number of (zero-length)
sequences, so the eager run is fine.
Doctor: undersized-buffer, at ``collate_fn`` (it builds ``cu_seqlens`` with more entries than the graphs' captured
``cu_seqlens`` input holds: data that does not fit the static buffer).
Fix (upstream): ``pad_num = max_samples_per_bin - len(cu_seqlens[-1]) + 2`` ("plus 2 since cu_seqlens additionally
contains 0 and may append max_length"), with ``max_samples_per_bin`` and ``dataset_max_seqlen`` taken as the max
over a list of pack metadata (train and val), so every pack gives ``max_samples_per_bin + 2`` entries.
Modelled: one graphed decoder layer (single-head varlen attention; the kernel's grid covers ``max_seqlen`` query
rows per sequence, a host int launch argument), embedding and LM head eager, micro-batch size 1, forward only
(no backward graphs, no fp8, no DDP hooks); the per-micro-batch masked loss is the output. The pre-PR metadata
file held one dict; here it is a one-element list in both variants (the max over it is that dict). The packs are
chosen so that every padding tail is no longer than ``dataset_max_seqlen`` (not the #13779 problem). NeMo passes
``max_seqlen`` as a CPU tensor; here it is the int TE reads from it. Not modelled: the PR's other half (packed
validation reading a shared list of train+val metadata); before it, validation was not packed in NeMo 2.
"""

import dataclasses
import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/NeMo/pull/11748"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "collate_fn"
SYMPTOM = "a pack with more sequences than the recorded one gives a longer cu_seqlens and the layer graph refuses it"

VOCAB, DIM, EOS_ID = 16, 8, 0
MAX_SEQ_LENGTH = 16                       # pack_size; pad_to_max_length is required with pad_cu_seqlens
# sequence lengths of each packed sample, in the order the sampler serves them (micro-batch size 1)
PACKS = [[6, 6], [6, 6], [5, 6, 4], [4, 4, 4, 4], [6, 6, 3]]


def create_packing_strategy_metadata():
    """What ``prepare_packed_sequence_data`` writes to the metadata file (train split)."""
    return [{"dataset_max_seqlen": max(max(p) for p in PACKS), "max_samples_per_bin": max(len(p) for p in PACKS),
             "pack_size": MAX_SEQ_LENGTH}]


class GPTSFTPackedDataset:
    def __init__(self, samples, variant: str, pad_cu_seqlens: bool = True):
        self.samples, self.variant = samples, variant
        self.max_seq_length, self.pad_cu_seqlens = MAX_SEQ_LENGTH, pad_cu_seqlens
        self.pack_metadata = create_packing_strategy_metadata()

    def __getitem__(self, idx):
        input_ids, seqlens = self.samples[idx]
        seq_boundaries = [0] + np.cumsum(seqlens).tolist()
        return {"input_ids": input_ids, "seq_boundaries": seq_boundaries}

    @staticmethod
    def _collate_item(item, max_length, pad_id):
        return [list(x) + [pad_id] * (max_length - len(x)) for x in item]

    def collate_fn(self, batch):
        input_ids = [np.concatenate([item["input_ids"][item["seq_boundaries"][i]: item["seq_boundaries"][i + 1] - 1]
                                     for i in range(len(item["seq_boundaries"]) - 1)]) for item in batch]
        labels = [np.concatenate([item["input_ids"][item["seq_boundaries"][i] + 1: item["seq_boundaries"][i + 1]]
                                  for i in range(len(item["seq_boundaries"]) - 1)]) for item in batch]
        loss_mask = [[1] * len(x) for x in input_ids]
        max_length = self.max_seq_length                                  # pad_to_max_length
        position_ids, cu_seqlens = [], []
        for item in batch:
            position_ids.append([])
            cu_seqlens.append([0])
            seqlens = np.array(item["seq_boundaries"][1:]) - np.array(item["seq_boundaries"][:-1])
            for l in seqlens:
                # length minus 1 because input_ids is truncated by 1 for labels
                position_ids[-1].extend(list(range(l - 1)))
                cu_seqlens[-1].append(cu_seqlens[-1][-1] + int(l) - 1)
            if cu_seqlens[-1][-1] != max_length:
                cu_seqlens[-1].append(max_length)
            if self.pad_cu_seqlens:
                if self.variant == "bug":
                    # pad cu_seqlens with zero length sequences
                    pad_num = self.pack_metadata[0]["max_samples_per_bin"] - len(cu_seqlens[-1])
                else:
                    # pad cu_seqlens to a constant shape with zero length sequences
                    max_samples_per_bin = max(p["max_samples_per_bin"] for p in self.pack_metadata)
                    # plus 2 since cu_seqlens additionally contains 0 and may append max_length
                    pad_num = max_samples_per_bin - len(cu_seqlens[-1]) + 2
                cu_seqlens[-1].extend([max_length] * pad_num)

        input_ids = self._collate_item(input_ids, max_length=max_length, pad_id=EOS_ID)
        labels = self._collate_item(labels, max_length=max_length, pad_id=EOS_ID)
        loss_mask = self._collate_item(loss_mask, max_length=max_length, pad_id=0)
        position_ids = self._collate_item(position_ids, max_length=max_length, pad_id=0)
        cu_seqlens = self._collate_item(cu_seqlens, max_length=max(len(l) for l in cu_seqlens) + 1, pad_id=-1)
        cu_seqlens = torch.IntTensor(cu_seqlens)
        cu_seqlens_argmin = torch.argmin(cu_seqlens, dim=1, keepdim=True)
        if self.pad_cu_seqlens:
            # use the global max seqlen: the graphs take one max_seqlen for all batches
            max_seqlen = torch.IntTensor([max(p["dataset_max_seqlen"] for p in self.pack_metadata)] * len(cu_seqlens))
        else:
            seqlens = cu_seqlens[:, 1:] - cu_seqlens[:, :-1]
            max_seqlen, _ = seqlens.max(dim=1, keepdim=True)
        return {"tokens": torch.LongTensor(input_ids), "labels": torch.LongTensor(labels),
                "loss_mask": torch.FloatTensor(loss_mask), "position_ids": torch.LongTensor(position_ids),
                "cu_seqlens": cu_seqlens, "cu_seqlens_argmin": cu_seqlens_argmin, "max_seqlen": max_seqlen}


@dataclasses.dataclass
class PackedSeqParams:
    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None


def get_packed_seq_params(batch):
    cu_seqlens = batch["cu_seqlens"].squeeze()                     # remove batch size dimension (mbs=1)
    cu_seqlens = cu_seqlens[: batch["cu_seqlens_argmin"].item()]    # remove -1 "paddings" added in collate_fn
    max_seqlen = int(batch["max_seqlen"].squeeze())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def fused_attn_varlen(q, k, v, cu_seqlens, max_seqlen: int):
    """Causal THD attention over the sequences of ``cu_seqlens`` (zero-length ones included); the grid covers
    ``max_seqlen`` query rows per sequence."""
    t = torch.arange(q.shape[0], device=q.device)
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu, t, right=True) - 1
    pos = t - cu[seq]
    allowed = (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None])
    scores = (q @ k.t() / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return torch.where((pos < max_seqlen)[:, None], out, torch.zeros_like(out))


class TransformerLayer:
    def __init__(self, gen, device, enable_cuda_graph: bool):
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))
        if enable_cuda_graph:
            self.cudagraph_manager = CudaGraphManager(device)

    def forward(self, hidden_states, packed_seq_params):
        p = packed_seq_params
        h = hidden_states
        core_attn_out = fused_attn_varlen(h @ self.wq, h @ self.wk, h @ self.wv, p.cu_seqlens_q, p.max_seqlen_q)
        return h + torch.tanh(core_attn_out @ self.wo)

    def __call__(self, **kwargs):
        if hasattr(self, "cudagraph_manager"):
            return self.cudagraph_manager(self, kwargs)
        return self.forward(**kwargs)


class _CudaGraphRunner:
    """One fwd graph of one layer: recorded on the first micro-batch, captured by ``create_cudagraphs``."""

    def __init__(self, base_module, device):
        self.base_module, self.device = base_module, device
        self.fwd_graph, self.fwd_graph_recorded, self.cudagraph_created = None, False, False

    @staticmethod
    def replace_tensors(kwargs):
        """Replace all tensors inside kwargs with zeroed copies (the graph's input surface)."""
        out = {}
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                v = torch.zeros_like(v)
            elif dataclasses.is_dataclass(v):
                v = dataclasses.replace(v, **{f.name: torch.zeros_like(getattr(v, f.name))
                                              for f in dataclasses.fields(v) if torch.is_tensor(getattr(v, f.name))})
            out[k] = v
        return out

    @staticmethod
    def get_tensors(kwargs):
        tens = {}
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                tens[k] = v
            elif dataclasses.is_dataclass(v):
                tens.update({f"{k}.{f.name}": getattr(v, f.name) for f in dataclasses.fields(v)
                             if torch.is_tensor(getattr(v, f.name))})
        return tens

    def record_graph_capture(self, kwargs):
        self.recorded_kwargs = kwargs
        self.fwd_graph_recorded = True
        return self.base_module.forward(**kwargs)                   # run the forward pass as normal in eager mode

    def create_fwd_graph(self):
        self.fwd_graph_input_kwargs = self.replace_tensors(self.recorded_kwargs)
        self.fwd_graph_input_surface = self.get_tensors(self.fwd_graph_input_kwargs)
        self.fwd_graph, self.fwd_graph_output = capture(
            lambda: self.base_module.forward(**self.fwd_graph_input_kwargs), device=self.device, warmups=2,
            name="TransformerLayer fwd", owner="_CudaGraphRunner", static=self.fwd_graph_input_surface)
        self.cudagraph_created = True

    def matches_graph_inputs(self, kwargs):
        def check(val, ref):
            if not (type(val) == type(ref) or (dataclasses.is_dataclass(val) and dataclasses.is_dataclass(ref))):
                return False
            if isinstance(ref, torch.Tensor):
                return val.shape == ref.shape and val.dtype == ref.dtype and val.device == ref.device
            if dataclasses.is_dataclass(ref):
                return all(check(getattr(val, f.name), getattr(ref, f.name)) for f in dataclasses.fields(ref))
            return ref == val

        if kwargs.keys() != self.fwd_graph_input_kwargs.keys():
            return False
        return all(check(kwargs[k], v) for k, v in self.fwd_graph_input_kwargs.items())

    def replay_graph_capture(self, kwargs):
        assert self.matches_graph_inputs(kwargs), \
            "Tried replaying a cudagraph with different arguments than what if was created with!"
        for name, user_input in self.get_tensors(kwargs).items():   # _CudagraphFunc.forward
            cudagraph_input = self.fwd_graph_input_surface[name]
            if user_input.data_ptr() != cudagraph_input.data_ptr():
                cudagraph_input.copy_(user_input)
        out = replay(self.fwd_graph, self.fwd_graph_output)
        return out.clone().detach()                                 # last layer: a clone of the output buffer

    def __call__(self, kwargs):
        if not self.cudagraph_created:
            return self.record_graph_capture(kwargs)
        return self.replay_graph_capture(kwargs)


class CudaGraphManager:
    def __init__(self, device):
        self.device, self.cudagraph_runners = device, []

    def __call__(self, megatron_module, kwargs):
        if not self.cudagraph_runners:
            self.cudagraph_runners.append(_CudaGraphRunner(megatron_module, self.device))
        return self.cudagraph_runners[0](kwargs)

    def create_cudagraphs(self):
        for runner in self.cudagraph_runners:
            if runner.fwd_graph_recorded and not runner.cudagraph_created:
                runner.create_fwd_graph()


class GPTModel:
    def __init__(self, device, enable_cuda_graph: bool):
        gen = generator(11748)
        self.embedding = randn(VOCAB, DIM, gen=gen, device=device)
        self.position_embeddings = randn(MAX_SEQ_LENGTH, DIM, gen=gen, device=device, scale=0.5)
        self.decoder = TransformerLayer(gen, device, enable_cuda_graph)
        self.output_layer = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def forward(self, tokens, position_ids, labels, packed_seq_params):
        hidden_states = self.embedding[tokens] + self.position_embeddings[position_ids]
        hidden_states = self.decoder(hidden_states=hidden_states, packed_seq_params=packed_seq_params)
        logits = hidden_states @ self.output_layer
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none")


def gpt_forward_step(model, batch, device):
    b = {k: (v.to(device) if k != "cu_seqlens_argmin" and k != "max_seqlen" else v) for k, v in batch.items()}
    losses = model.forward(b["tokens"][0], b["position_ids"][0], b["labels"][0], get_packed_seq_params(b))
    loss_mask = b["loss_mask"][0]
    return torch.sum(losses * loss_mask) / loss_mask.sum()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(117)
    samples = [(torch.randint(1, VOCAB, (sum(p),), generator=gen).numpy(), p) for p in PACKS]

    def train(enable_cuda_graph: bool):
        ds = GPTSFTPackedDataset(samples, variant)
        model, outs = GPTModel(device, enable_cuda_graph), []
        with torch.no_grad():
            for step in range(len(PACKS)):
                outs.append(gpt_forward_step(model, ds.collate_fn([ds[step]]), device))
                if enable_cuda_graph and step == 0:
                    model.decoder.cudagraph_manager.create_cudagraphs()
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: train(True), lambda: train(False))
