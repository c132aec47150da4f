"""Tiny, seeded ``transformers`` models: real model code nobody here wrote, for fidelity checks.

No network: configs are built in code and weights are random but seeded, so every run builds the
same model.
"""
from __future__ import annotations

import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, RobertaConfig, RobertaModel

VOCAB = 100


def tiny_model(name: str, *, hidden: int = 32, layers: int = 2, heads: int = 4, positions: int = 128,
               seed: int = 0) -> torch.nn.Module:
    """``"roberta"``, ``"bert"`` or ``"gpt2"`` in eval mode, weights from ``seed``."""
    torch.manual_seed(seed)
    if name == "roberta":
        model = RobertaModel(RobertaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                           num_attention_heads=heads, intermediate_size=2 * hidden,
                                           max_position_embeddings=positions + 2))
    elif name == "bert":
        model = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=2 * hidden,
                                     max_position_embeddings=positions))
    elif name == "gpt2":
        model = GPT2Model(GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads,
                                     n_positions=positions, bos_token_id=0, eos_token_id=0))
    else:
        raise ValueError(f"unknown model {name!r}: choose 'roberta', 'bert' or 'gpt2'")
    return model.eval()
