"""encode() on Gaudi keeps row views of the HPU graph's output embeddings across batches, so the next same-shape batch's replay overwrites them.

Upstream: https://github.com/huggingface/sentence-transformers/pull/2630 ("Enable Sentence Transformer Inference with
Intel Gaudi2 GPU Supported ( 'hpu' ) - Follow up for #2557", merged 2024-05-13, commit de3b29890344). The graph
wrapping came in with https://github.com/huggingface/sentence-transformers/pull/2557 (merged 2024-04-08, shipped in
v2.7.0 without this fix).
Symptom: on an HPU device, ``model.encode(sentences, convert_to_tensor=True)`` with more sentences than
``batch_size`` returns wrong embeddings: every row of an earlier batch holds the embedding of a sentence of a later
batch with the same padded shape (duplicated vectors, wrong similarities), silently. The PR's own trigger was
``test_encode_truncate`` (#2573) failing on Gaudi; its author: "the variables of features/out_features are using
one single memory and out_features just adding additional key". On CPU/CUDA (no HPU graph) encode is right.
Mechanism: ``sentence_transformers/SentenceTransformer.py``. On the first ``encode()`` on HPU, #2557 calls
``habana_frameworks.torch.hpu.wrap_in_hpu_graph(self, disable_tensor_cache=True)``: ``wrapped_hpugraph_forward``
keys a cache on ``input_hash`` (the features dict's keys and tensor shapes), records the forward once per key and
on every later call replays and returns ``cached.graph_outputs``: the same dict and the same output tensors, which
each replay rewrites (CUDA-graph output semantics). ``tokenize`` pads to ``max_length`` on HPU, so every full batch
hits one graph. ``SentenceTransformer.forward`` (``nn.Sequential``) returns the features dict that ``Transformer``
and ``Pooling`` update in place, so ``out_features`` holds ``token_embeddings`` and ``sentence_embedding`` of the
graph. ``encode()`` then takes ``embeddings = out_features["sentence_embedding"].detach()`` (a view) and
``all_embeddings.extend(embeddings)`` keeps one view per row; with ``convert_to_tensor=True`` nothing copies them
(``.cpu()`` runs only for ``convert_to_numpy``). The next batch's replay rewrites the graph's
``sentence_embedding``; the final ``torch.stack(all_embeddings)`` reads the earlier rows after that. (The same
returned dict also keeps ``encode()``'s ``out_features["sentence_embedding"] = truncate_embeddings(...)`` rebinding
across calls, which is what broke ``test_encode_truncate``; not exercised here.)
Doctor: overwritten-output, at ``encode`` (it keeps the row views of the graph output handed out by one replay in
``all_embeddings`` and reads them at the final ``torch.stack`` after the next batch's replay overwrote them; the
fix changed only ``encode``, right after ``self.forward``).
Fix (upstream): ``out_features = self.forward(features)`` is followed by ``if self.device.type == "hpu":
out_features = copy.deepcopy(out_features)``, so the dict and its tensors kept by ``encode`` are the caller's own.
The PR also pads ``input_ids``/``attention_mask``/``token_type_ids`` to the next power of two instead of
``max_length`` (bucketing; not modelled: it keeps same-length batches on one graph either way).
Modelled: the Gaudi device is the kit's device with ``device_type = "hpu"``; ``wrap_in_hpu_graph`` /
``wrapped_hpugraph_forward`` follow habana_frameworks' code (cache keyed by ``input_hash``, here over shapes and
dtypes instead of ``_hpu_C.get_view_hash``; capture on first call,
then the dry-run replay, later calls replay and return ``cached.graph_outputs``); the ``disable_tensor_cache``
path's ``replayV3`` binding of user inputs is modelled as its ``copy_to(cached.graph_inputs, inputs)`` path (the
graph reads its captured input tensors, refreshed per call). The eager reference is the same HPU model without the
graph wrap. The BERT is one embedding layer (word + token type) and one masked self-attention layer; the tokenizer
maps words ``w<k>`` to ids with [CLS]/[SEP] and pads to ``max_length``; ``Pooling`` is mean pooling. Only the
``sentence_embedding`` output path of ``encode`` is kept (no prompts, normalisation, precision, numpy).
"""
from __future__ import annotations

import copy
import math

import numpy as np
import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/huggingface/sentence-transformers/pull/2630"
FAMILY = "dangling references"
KIND = "overwritten-output"
SITE = "encode"
SYMPTOM = ("encode(convert_to_tensor=True) on HPU: rows of earlier batches are views of the HPU graph's output, "
           "overwritten by the next same-shape batch's replay (earlier sentences get later sentences' embeddings)")

VOCAB, HIDDEN, MAX_SEQ_LENGTH = 24, 8, 8
PAD_ID, CLS_ID, SEP_ID = 0, 1, 2
BATCH_SIZE, N_SENTENCES = 4, 10            # batches of 4, 4, 2 (two graphs: bs 4 is replayed)


# --- habana_frameworks/torch/hpu/graphs.py ------------------------------------------------------------------------

class CachedParams:
    def __init__(self, graph_inputs, graph_outputs, graph, out_tensors):
        self.graph_inputs = graph_inputs
        self.graph_outputs = graph_outputs
        self.graph = graph
        self.out_tensors = out_tensors          # the tensors the graph writes (its user outputs)


def input_hash(obj):
    if isinstance(obj, dict):
        return input_hash(tuple(obj.items()))
    elif isinstance(obj, list) or isinstance(obj, tuple):
        return hash(tuple(input_hash(el) for el in obj))
    elif torch.is_tensor(obj):
        return hash((tuple(obj.shape), obj.dtype))
    else:
        return hash(obj)


def copy_to(dst, src):
    assert type(dst) == type(src)
    if isinstance(dst, dict):
        for (dk, dv), (sk, sv) in zip(dst.items(), src.items()):
            assert dk == sk
            copy_to(dv, sv)
    elif isinstance(dst, list) or isinstance(dst, tuple):
        for d, s in zip(dst, src):
            copy_to(d, s)
    elif torch.is_tensor(dst):
        dst.copy_(src, non_blocking=True)


def extract_tensors(data):
    tensors = []
    if isinstance(data, torch.Tensor):
        tensors.append(data)
    elif isinstance(data, (list, tuple)):
        for item in data:
            tensors.extend(extract_tensors(item))
    elif isinstance(data, dict):
        for value in data.values():
            tensors.extend(extract_tensors(value))
    return tensors


def wrapped_hpugraph_forward(cache, device, orig_fwd, args, kwargs):
    inputs = (args, kwargs)
    h = input_hash(inputs)
    cached = cache.get(h)
    if cached is None:
        input_tensor_list = extract_tensors(inputs)
        graph, outputs = capture(lambda: orig_fwd(*args, **kwargs), device=device, warmups=0,
                                 name=f"hpu graph {tuple(input_tensor_list[0].shape)}",
                                 owner="habana_frameworks wrap_in_hpu_graph",
                                 static={k: v for k, v in args[0].items() if torch.is_tensor(v)})
        graph_outputs = outputs
        out_tensors = tuple(t for t in extract_tensors(outputs) if not any(t is i for i in input_tensor_list))
        cache[h] = CachedParams(inputs, graph_outputs, graph, out_tensors)
        replay(graph, out_tensors)              # dry_run: graph.replayV3(...) right after the capture
        return outputs
    copy_to(cached.graph_inputs, inputs)
    replay(cached.graph, cached.out_tensors)
    return cached.graph_outputs


def wrap_in_hpu_graph(module, disable_tensor_cache=False, device="cpu"):
    cache = {}
    orig_fwd = module.forward

    def forward(*args, **kwargs):
        return wrapped_hpugraph_forward(cache, device, orig_fwd, args, kwargs)

    module.forward = forward
    return module


# --- sentence_transformers/models/Transformer.py, Pooling.py --------------------------------------------------------

class BertModel:
    """One embedding layer and one masked self-attention layer (``return_dict=False``: ``(last_hidden_state,)``)."""

    def __init__(self, device):
        gen = generator(2630)
        self.word_embeddings = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.token_type_embeddings = randn(2, HIDDEN, gen=gen, device=device, scale=0.3)
        self.w_q = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_k = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
        self.w_o = randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)

    def __call__(self, input_ids, attention_mask, token_type_ids, return_dict=False):
        h = self.word_embeddings[input_ids] + self.token_type_embeddings[token_type_ids]
        scores = (h @ self.w_q) @ (h @ self.w_k).transpose(1, 2) / math.sqrt(HIDDEN)
        scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        return (torch.tanh(h + torch.softmax(scores, -1) @ h @ self.w_o),)


class Transformer(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.auto_model = BertModel(device)
        self.max_seq_length = MAX_SEQ_LENGTH

    def forward(self, features):
        """Returns token_embeddings, cls_token"""
        trans_features = {"input_ids": features["input_ids"], "attention_mask": features["attention_mask"]}
        if "token_type_ids" in features:
            trans_features["token_type_ids"] = features["token_type_ids"]
        output_states = self.auto_model(**trans_features, return_dict=False)
        output_tokens = output_states[0]
        features.update({"token_embeddings": output_tokens, "attention_mask": features["attention_mask"]})
        return features

    def tokenize(self, texts, padding=True):
        """words ``w<k>`` -> id k + 3, with [CLS]/[SEP]; ``padding="max_length"`` pads to ``max_seq_length``."""
        ids = [[CLS_ID] + [int(w[1:]) + 3 for w in t.strip().split()][: self.max_seq_length - 2] + [SEP_ID]
               for t in texts]
        width = self.max_seq_length if padding == "max_length" else max(len(i) for i in ids)
        return {"input_ids": torch.tensor([i + [PAD_ID] * (width - len(i)) for i in ids]),
                "token_type_ids": torch.zeros(len(ids), width, dtype=torch.long),
                "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])}


class Pooling(torch.nn.Module):
    def forward(self, features):
        token_embeddings = features["token_embeddings"]
        attention_mask = features["attention_mask"]
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
        sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
        sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
        output_vector = sum_embeddings / sum_mask
        features.update({"sentence_embedding": output_vector})
        return features


# --- sentence_transformers/util.py ----------------------------------------------------------------------------------

def truncate_embeddings(embeddings, truncate_dim):
    return embeddings[..., :truncate_dim]


def batch_to_device(batch, target_device):
    for key in batch:
        if isinstance(batch[key], torch.Tensor):
            batch[key] = batch[key].to(target_device)
    return batch


# --- sentence_transformers/SentenceTransformer.py --------------------------------------------------------------------

class SentenceTransformer(torch.nn.Sequential):
    def __init__(self, device, variant, hpu_graphs=True, truncate_dim=None):
        super().__init__(Transformer(device), Pooling())
        self.target_device = device
        self.device_type = "hpu"                # a Gaudi device (see Modelled)
        self.hpu_graphs = hpu_graphs            # False: the eager reference (same model, no graph wrap)
        self.variant = variant
        self.truncate_dim = truncate_dim
        self.is_hpu_graph_enabled = False

    def tokenize(self, texts):
        kwargs = {}
        # HPU models reach optimal performance if the padding is not dynamic
        if self.device_type == "hpu":
            kwargs["padding"] = "max_length"
        return self[0].tokenize(texts, **kwargs)

    def _text_length(self, text):
        return len(text)

    def encode(self, sentences, batch_size=32, output_value="sentence_embedding", convert_to_numpy=True,
               convert_to_tensor=False):
        if self.device_type == "hpu" and self.hpu_graphs and not self.is_hpu_graph_enabled:
            wrap_in_hpu_graph(self, disable_tensor_cache=True, device=self.target_device)
            self.is_hpu_graph_enabled = True
        if convert_to_tensor:
            convert_to_numpy = False
        device = self.target_device

        all_embeddings = []
        length_sorted_idx = np.argsort([-self._text_length(sen) for sen in sentences], kind="stable")
        sentences_sorted = [sentences[idx] for idx in length_sorted_idx]

        for start_index in range(0, len(sentences), batch_size):
            sentences_batch = sentences_sorted[start_index: start_index + batch_size]
            features = self.tokenize(sentences_batch)
            features = batch_to_device(features, device)

            with torch.no_grad():
                out_features = self.forward(features)
                if self.variant == "fix" and self.device_type == "hpu":      # PR #2630
                    out_features = copy.deepcopy(out_features)
                out_features["sentence_embedding"] = truncate_embeddings(
                    out_features["sentence_embedding"], self.truncate_dim
                )
                embeddings = out_features[output_value]
                embeddings = embeddings.detach()
                # fixes for #522 and #487 to avoid oom problems on gpu with large datasets
                if convert_to_numpy:
                    embeddings = embeddings.cpu()
                all_embeddings.extend(embeddings)

        all_embeddings = [all_embeddings[idx] for idx in np.argsort(length_sorted_idx, kind="stable")]
        if convert_to_tensor:
            all_embeddings = torch.stack(all_embeddings)
        return all_embeddings


def run(variant: str, device: str = "cpu"):
    gen = generator(2557)
    lengths = torch.randint(1, MAX_SEQ_LENGTH - 1, (N_SENTENCES,), generator=gen).tolist()
    sentences = [" ".join(f"w{k}" for k in torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist())
                 for n in lengths]

    def serve(hpu_graphs: bool):
        model = SentenceTransformer(device, variant, hpu_graphs=hpu_graphs)
        corpus_embeddings = model.encode(sentences, batch_size=BATCH_SIZE, convert_to_tensor=True)
        return [corpus_embeddings]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
