"""RoBERTa encoder in vLLM's serving style, with the position-offset ``bug`` and ``fix`` side by side.

Upstream: ``vllm/model_executor/models/roberta.py`` (``RobertaEmbeddingModel``, ``RobertaEmbedding``,
``replace_roberta_positions``) on top of ``vllm/model_executor/models/bert.py`` (``BertModel``).

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

import torch
from torch import nn

VARIANTS = ("bug", "fix")


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
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant
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
