"""A tiny XLM with random weights and a synthetic batch, in place of xlm-mlm-ende-1024 and Multi30k (port helper)."""

import torch
from transformers import XLMConfig, XLMWithLMHeadModel

PAD = 1


def tiny_xlm():
    torch.manual_seed(0)
    config = XLMConfig(vocab_size=40, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64, return_dict=False)
    return XLMWithLMHeadModel(config).eval()


def batch(vocab_en=60, vocab_de=70):
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(2, vocab_en, (19, 5), generator=generator)
    trg = torch.randint(2, vocab_de, (21, 5), generator=generator)
    src[-3:, 2] = PAD
    trg[-4:, 1] = PAD
    return src, trg
