"""The tiny Llama the trainer-pass tests share: 2 layers, 32 wide, a 40-token vocabulary."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, PAD = 40, 0


def tiny_llama() -> LlamaForCausalLM:
    """Deterministic (seed 0), in eval mode."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()
