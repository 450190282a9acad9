"""A tokenizer of numbers: what captum's ``LLMAttribution`` asks of one, for parity tests on tiny random LMs."""

from __future__ import annotations

import re

import torch


class NumberTokenizer:
    """Token ids written as numbers, ``"3 5 7"`` for ``[3, 5, 7]``: what captum's LLMAttribution asks of a tokenizer."""

    def encode(self, text, return_tensors=None, add_special_tokens=True):
        ids = [int(t) for t in text.split()]
        return torch.tensor([ids]) if return_tensors == "pt" else ids

    def decode(self, ids):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return " ".join(str(i) for i in ([ids] if isinstance(ids, int) else ids))

    def __call__(self, text, return_offsets_mapping=False, add_special_tokens=True, **kwargs):
        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        return {"input_ids": [int(text[a:b]) for a, b in spans], "offset_mapping": spans}

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        return [int(t) for t in tokens]
