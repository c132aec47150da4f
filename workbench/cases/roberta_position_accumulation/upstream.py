"""The mirrored upstream code: RoBERTa in vLLM's serving style, with the position-offset ``bug`` and
``fix`` side by side, and the part of vLLM's model runner that starts it and serves it.

Upstream: ``vllm/model_executor/models/roberta.py`` (``RobertaEmbeddingModel``, ``RobertaEmbedding``,
``replace_roberta_positions``) on top of ``vllm/model_executor/models/bert.py`` (``BertModel``);
``vllm/v1/worker/gpu_worker.py`` and ``gpu_model_runner.py`` (startup, ``_dummy_run``, serving).

RoBERTa numbers positions from ``padding_idx + 1`` (= 2), while vLLM's runner hands every model
positions from 0. The two versions add the offset differently:

* ``bug`` (vLLM 0.18.1): ``RobertaEmbeddingModel.forward`` first calls ``replace_roberta_positions``,
  which does ``position_ids += padding_idx + 1`` **in place**, on the view of the runner's
  persistent ``positions`` buffer it was handed. It then runs ``BertModel`` (the compiled part).
* ``fix`` (vLLM 0.19.0, PR #37884): no in-place add; the embedding looks up
  ``position_ids + padding_idx + 1``, a new tensor.

Serving-style means: one flattened token dimension holding several requests, ``positions`` given
by the runner, attention restricted to tokens of the same request (vLLM's encoder-only attention
does this with ``query_start_loc``; here ``request_ids`` holds, per token, the request it belongs
to, ``-1`` for padded tokens, and the mask is built on the device, so capture needs no host sync).

Weights come from ``transformers.RobertaModel`` (``from_transformers``), with q/k/v stacked into one
``qkv_proj`` as vLLM's loader does.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from .. import check_variant
from ...engine import CUDAGraphMode, GraphError, GraphManager, resolve_device, validate_capture_sizes


def replace_roberta_positions(input_ids: torch.Tensor, position_ids: torch.Tensor, padding_idx: int) -> None:
    """vLLM 0.18.1, verbatim in effect: shift positions to RoBERTa's numbering, in place.

    ``position_ids`` is a view of the runner's persistent buffer, so this writes into it. Slots
    the runner refreshes every step are harmless; padded slots it never refreshes gain
    ``padding_idx + 1`` at every step.
    """
    # vllm does not use padding tokens, let's make things simpler
    position_ids += padding_idx + 1


class RobertaEmbedding(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm (vLLM ``RobertaEmbedding``)."""

    def __init__(self, config, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.padding_idx = config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=self.padding_idx)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        inputs_embeds = self.word_embeddings(input_ids)
        if self.variant == "fix":
            # RoBERTa positions start at padding_idx + 1 instead of 0. Non-in-place add: the
            # persistent positions buffer is left as the runner wrote it.
            position_embeddings = self.position_embeddings(position_ids + self.padding_idx + 1)
        else:
            # Already shifted in place by replace_roberta_positions.
            position_embeddings = self.position_embeddings(position_ids)
        token_type_ids = torch.zeros(input_ids.shape, dtype=torch.long, device=input_ids.device)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(inputs_embeds + token_type_embeddings + position_embeddings)


class BertSelfAttention(nn.Module):
    """Non-causal attention over flattened tokens, each token seeing only its own request."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_size ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, hidden_states: torch.Tensor, same_request: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).view(tokens, 3, self.num_heads, self.head_size).unbind(1)
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))                  # [heads, tokens, head_size]
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scaling
        scores = scores.masked_fill(~same_request, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.transpose(0, 1).reshape(tokens, -1)


class BertLayer(nn.Module):
    """Attention + feed-forward, each followed by residual add and LayerNorm (vLLM ``BertLayer``)."""

    def __init__(self, config) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention = BertSelfAttention(config)
        self.attention_dense = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Linear(h, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=eps)
        if config.hidden_act != "gelu":
            raise ValueError(f"only hidden_act='gelu' is implemented, got {config.hidden_act!r}")

    def forward(self, hidden_states: torch.Tensor, same_request: torch.Tensor) -> torch.Tensor:
        attn = self.attention_dense(self.attention(hidden_states, same_request))
        hidden_states = self.attention_norm(attn + hidden_states)
        ffn = self.output(nn.functional.gelu(self.intermediate(hidden_states)))
        return self.output_norm(ffn + hidden_states)


class BertModel(nn.Module):
    """Embeddings + encoder layers: the part vLLM compiles (``@support_torch_compile``)."""

    def __init__(self, config, variant: str) -> None:
        super().__init__()
        self.embeddings = RobertaEmbedding(config, variant)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, request_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids, positions)
        same_request = request_ids[:, None] == request_ids[None, :]   # [tokens, tokens], on the device
        for layer in self.layers:
            hidden_states = layer(hidden_states, same_request)
        return hidden_states


class RobertaEmbeddingModel(nn.Module):
    """vLLM ``RobertaEmbeddingModel``: ``pre_model`` (eager Python) then ``model`` (compiled).

    ``forward(input_ids, positions, request_ids)`` returns the last hidden state of every token,
    ``[tokens, hidden]``. ``pre_model`` is split out because vLLM's PIECEWISE mode captures only
    the compiled ``BertModel`` into graphs: whatever ``forward`` does before calling it runs eagerly
    at every step, during warmup and during capture alike.
    """

    def __init__(self, config, variant: str) -> None:
        super().__init__()
        self.variant = check_variant(variant)
        self.padding_idx = config.pad_token_id
        self.model = BertModel(config, variant)

    def pre_model(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """What ``RobertaEmbeddingModel.forward`` runs before ``BertModel``: the in-place shift (bug)."""
        if self.variant == "bug":
            replace_roberta_positions(input_ids=input_ids, position_ids=positions, padding_idx=self.padding_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, request_ids: torch.Tensor) -> torch.Tensor:
        self.pre_model(input_ids, positions)
        return self.model(input_ids, positions, request_ids)

    @property
    def index_offset(self) -> int:
        """What the embedding adds to the positions buffer's values when it looks them up."""
        return self.padding_idx + 1 if self.variant == "fix" else 0


def from_transformers(hf_model, variant: str, device: str = "cpu") -> RobertaEmbeddingModel:
    """Build the serving model with ``hf_model``'s weights (a ``transformers.RobertaModel``)."""
    config = hf_model.config
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"only absolute position embeddings are implemented, got "
                         f"{config.position_embedding_type!r} (vLLM serves those with JinaRobertaModel)")
    model = RobertaEmbeddingModel(config, variant)
    hf = hf_model.state_dict()
    ours = {
        "model.embeddings.word_embeddings.weight": hf["embeddings.word_embeddings.weight"],
        "model.embeddings.position_embeddings.weight": hf["embeddings.position_embeddings.weight"],
        "model.embeddings.token_type_embeddings.weight": hf["embeddings.token_type_embeddings.weight"],
        "model.embeddings.LayerNorm.weight": hf["embeddings.LayerNorm.weight"],
        "model.embeddings.LayerNorm.bias": hf["embeddings.LayerNorm.bias"],
    }
    for i in range(config.num_hidden_layers):
        p, q = f"encoder.layer.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            ours[q + f"attention.qkv_proj.{kind}"] = torch.cat(
                [hf[p + f"attention.self.{name}.{kind}"] for name in ("query", "key", "value")])
            ours[q + f"attention_dense.{kind}"] = hf[p + f"attention.output.dense.{kind}"]
            ours[q + f"attention_norm.{kind}"] = hf[p + f"attention.output.LayerNorm.{kind}"]
            ours[q + f"intermediate.{kind}"] = hf[p + f"intermediate.dense.{kind}"]
            ours[q + f"output.{kind}"] = hf[p + f"output.dense.{kind}"]
            ours[q + f"output_norm.{kind}"] = hf[p + f"output.LayerNorm.{kind}"]
    model.load_state_dict(ours, strict=True)
    return model.to(device).eval()


# --------------------------------------------------------------------------- vLLM's startup
def vllm_capture_sizes(max_capture_size: int) -> list[int]:
    """vLLM's default ``cudagraph_capture_sizes``: 1, 2, 4, then every 8 below 256, every 16 above."""
    if max_capture_size < 1:
        raise ValueError(f"max_capture_size must be >= 1, got {max_capture_size}")
    sizes = [s for s in (1, 2, 4) if s <= max_capture_size]
    sizes += list(range(8, min(max_capture_size + 1, 256), 8))
    sizes += list(range(256, max_capture_size + 1, 16))
    return sizes


@dataclasses.dataclass(frozen=True)
class DummyRun:
    """One startup call of the model on ``positions[:num_tokens]`` (vLLM ``_dummy_run``)."""

    kind: str          # "profile", "warmup", "capture" or "pooler warmup"
    num_tokens: int


def startup_runs(capture_sizes: Sequence[int], *, max_num_tokens: int, max_num_reqs: int,
                 num_warmups: int = 1, enforce_eager: bool = False) -> list[DummyRun]:
    """The model calls vLLM makes before serving, in order (v0.18.1 ``gpu_worker`` / ``gpu_model_runner``).

    ``determine_available_memory`` -> ``profile_run``: one run at ``max_num_tokens``.
    ``compile_or_warm_up_model`` -> ``capture_model``: per capture size, largest first,
    ``cudagraph_num_of_warmups`` eager runs then the capture run; then the pooler warmup, one eager
    run at ``max_num_reqs = min(max_num_seqs, max_num_batched_tokens)``. Not modelled: extra
    ``compile_sizes`` (empty by default) and FULL decode-only graphs (embedding requests are
    prefills: they run the PIECEWISE "mixed prefill-decode" graphs).
    """
    runs = [DummyRun("profile", max_num_tokens)]
    if not enforce_eager:
        for size in sorted(capture_sizes, reverse=True):
            runs += [DummyRun("warmup", size)] * num_warmups + [DummyRun("capture", size)]
    return runs + [DummyRun("pooler warmup", max_num_reqs)]


# --------------------------------------------------------------------------- the runner
class RobertaRunner:
    """vLLM's GPU model runner for this model: its buffer policy on top of a ``GraphManager``.

    The manager warms up and captures each size, largest first, into one pool; this class keeps
    what vLLM does around the graphs, where the bug lives:

    * Persistent ``input_ids`` and ``positions`` buffers sized for the largest capture size. A batch
      refreshes only its real tokens' slots (``copy_to_gpu(n)``); padded slots keep what the last
      writer left there.
    * ``capture()`` runs vLLM's whole startup (``startup_runs``) on views of the buffers, never
      refreshing them, as ``_dummy_run`` does: the profile run, the manager's warmups and captures,
      and the pooler warmup. ``request_ids`` start as zeros, so every startup batch is one request.
    * Attention metadata (``request_ids``) is rebuilt over the whole padded batch every step, as
      vLLM's attention builder rebuilds ``query_start_loc``.
    * ``cudagraph_mode``: ``PIECEWISE`` captures only ``model.model`` and runs ``model.pre_model``
      eagerly before it at every replay (``manager.eager``), as vLLM does for these prefill-only
      models; ``FULL`` captures ``model.forward`` whole.

    ``zero_padding=True`` is the second upstream defence (#37873): zero the padded positions
    before the model runs. ``enforce_eager=True`` (or mode ``NONE``): no graphs, no padding.
    """

    def __init__(self, model: RobertaEmbeddingModel, capture_sizes: Sequence[int], *, device: str = "cpu",
                 cudagraph_mode: CUDAGraphMode | str = CUDAGraphMode.PIECEWISE, zero_padding: bool = False,
                 enforce_eager: bool = False, num_warmups: int = 1, max_num_reqs: int | None = None) -> None:
        mode = CUDAGraphMode.of(cudagraph_mode)
        self.enforce_eager = enforce_eager or mode is CUDAGraphMode.NONE
        self.cudagraph_mode = CUDAGraphMode.NONE if self.enforce_eager else mode
        self.model = model
        self.zero_padding = zero_padding
        self.capture_sizes = validate_capture_sizes(capture_sizes)
        self.max_size = self.capture_sizes[-1]
        self.device = resolve_device(device)
        self.max_num_reqs = self.max_size if max_num_reqs is None else max_num_reqs
        if not 1 <= self.max_num_reqs <= self.max_size:
            raise ValueError(f"max_num_reqs must be in [1, {self.max_size}], got {max_num_reqs}")
        self.buffers = {"input_ids": torch.zeros(self.max_size, dtype=torch.int32, device=self.device),
                        "positions": torch.zeros(self.max_size, dtype=torch.int64, device=self.device)}
        self.request_ids = torch.zeros(self.max_size, dtype=torch.int64, device=self.device)
        self.manager = GraphManager(self._forward, self.capture_sizes, device=self.device,
                                    mode=self.cudagraph_mode, num_warmups=num_warmups,
                                    static_buffers=self.buffers, name=type(self).__name__)
        self.num_warmups = self.manager.num_warmups
        self._pre_model = self.manager.eager(model.pre_model)
        self.startup: list[DummyRun] = []

    def _model_inputs(self, rows: int) -> dict[str, torch.Tensor]:
        return {name: buf[:rows] for name, buf in self.buffers.items()} | {"request_ids": self.request_ids[:rows]}

    def _forward(self, size: int) -> torch.Tensor:
        """``model.forward`` with ``pre_model`` as an eager region: captured whole in FULL mode,
        run eagerly before the captured ``BertModel`` in PIECEWISE mode."""
        inputs = self._model_inputs(size)
        self._pre_model(inputs["input_ids"], inputs["positions"])
        return self.model.model(**inputs)

    def _eager_run(self, num_tokens: int) -> None:
        with torch.no_grad():
            self.model(**self._model_inputs(num_tokens))

    def capture(self) -> list[DummyRun]:
        """Run vLLM's startup: profile run, warmups and captures, pooler warmup. Returns the runs."""
        if self.startup:
            raise GraphError("capture() was already called; create a new runner to start again.")
        self.startup = startup_runs(self.capture_sizes, max_num_tokens=self.max_size,
                                    max_num_reqs=self.max_num_reqs, num_warmups=self.num_warmups,
                                    enforce_eager=self.enforce_eager)
        profile, pooler = self.startup[0], self.startup[-1]
        self._eager_run(profile.num_tokens)
        self.manager.capture()          # the warmups and captures of startup_runs, in its order
        self._eager_run(pooler.num_tokens)
        return self.startup

    def padded_size(self, n: int) -> int | None:
        """The graph size ``n`` tokens run at (``None``: eager)."""
        return self.manager.dispatch(n)

    def __call__(self, requests: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Serve one batch of requests (1-D token tensors); returns each request's hidden states."""
        if not requests:
            raise ValueError("empty batch: give at least one request")
        lens = [int(r.numel()) for r in requests]
        if min(lens) == 0 or any(r.dim() != 1 for r in requests):
            raise ValueError(f"each request must be a non-empty 1-D token tensor, got lengths {lens}")
        n = sum(lens)
        if n > self.max_size:
            raise ValueError(f"{n} tokens exceed the runner's {self.max_size} (its largest capture size)")
        if not self.enforce_eager and not self.manager.graphs:
            raise GraphError("no graphs captured yet: call runner.capture() before serving")
        size = self.padded_size(n)
        rows = n if size is None else size
        # What _prepare_inputs writes: real tokens and their positions, metadata for the padded batch.
        self.buffers["input_ids"][:n].copy_(torch.cat(requests).to(torch.int32))
        self.buffers["positions"][:n].copy_(torch.cat([torch.arange(k) for k in lens]))
        request_ids = torch.full((rows,), -1, dtype=torch.int64)
        request_ids[:n] = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        self.request_ids[:rows].copy_(request_ids)
        if self.zero_padding and rows > n:
            self.buffers["positions"][n:rows].zero_()                   # vLLM 0.19.0 _preprocess
        if size is None:
            with torch.no_grad():
                out = self.model(**self._model_inputs(rows))
        else:
            out = self.manager.replay(size, n, padded=self.buffers)
        starts = np.cumsum([0] + lens)
        return [out[a:b] for a, b in zip(starts[:-1], starts[1:])]
