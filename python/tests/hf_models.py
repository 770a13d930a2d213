"""Tiny random-initialised models of four transformers families, built in code (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=512)

# Each family at a different head_dim and head grouping:
#   llama   GQA 4:2, head_dim 64
#   qwen2   MQA 4:1, head_dim 128, q/k/v biases
#   mistral GQA 8:2, head_dim 64; "mistral_sliding": every layer a sliding window of 16
#   gemma3  GQA 4:2, head_dim 256, sliding (window 8) and global layers mixed, q/k norms,
#           query_pre_attn_scalar
FAMILIES = {
    "llama": lambda: (
        LlamaForCausalLM,
        LlamaConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64),
    ),
    "qwen2": lambda: (
        Qwen2ForCausalLM,
        Qwen2Config(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=128),
    ),
    "mistral": lambda: (
        MistralForCausalLM,
        MistralConfig(**COMMON, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, sliding_window=None),
    ),
    "mistral_sliding": lambda: (
        MistralForCausalLM,
        MistralConfig(**COMMON, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, sliding_window=16),
    ),
    "gemma3": lambda: (
        Gemma3ForCausalLM,
        Gemma3TextConfig(**COMMON, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=256, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         query_pre_attn_scalar=64),
    ),
}


def build(family: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0):
    cls, config = FAMILIES[family]()
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.set_attn_implementation(attn)
    return model


def prompt(batch: int = 1, length: int = 10, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)
