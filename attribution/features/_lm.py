"""The local language-model client: a HuggingFace causal LM asked in batches for replies or next-token probabilities."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from .._run import kept_state
from ._passages import SIMULATION_PROMPT


class _LM:
    """A HuggingFace causal LM and its tokenizer, asked in batches on the model's device."""

    def __init__(self, pair: tuple[nn.Module, Any], what: str) -> None:
        model, tokenizer = pair
        if not isinstance(model, nn.Module) or not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(
                f"`{what}` must be a callable or (model, tokenizer) with a HuggingFace causal LM and its tokenizer; "
                f"got ({type(model).__name__}, {type(tokenizer).__name__})"
            )
        self.model, self.tokenizer = model, tokenizer
        parameter = next(model.parameters(), None)
        self.device = parameter.device if parameter is not None else torch.device("cpu")
        eos = getattr(tokenizer, "eos_token_id", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.eos: int | None = eos
        self.pad: int = pad if pad is not None else eos if eos is not None else 0

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens added."""
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def start(self, prompt: str, answer: str) -> list[int]:
        """The ids of the prompt as the user's turn (chat template) or as plain text, the answer begun."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return self.encode(str(text) + answer)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return ([] if bos is None else [int(bos)]) + self.encode(f"{prompt}\n\n{answer}")

    def value_ids(self, values: Sequence[int]) -> list[list[int]]:
        """Per value, the ids of the tokens whose text stripped of white space is the value's digits."""
        size = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else int(self.tokenizer.vocab_size)
        batch_decode = getattr(self.tokenizer, "batch_decode", None)
        pieces = [[i] for i in range(size)]
        texts = [
            str(t) for t in (batch_decode(pieces) if callable(batch_decode) else map(self.tokenizer.decode, pieces))
        ]
        wanted = {str(v): j for j, v in enumerate(values)}
        groups: list[list[int]] = [[] for _ in values]
        for i, text in enumerate(texts):
            j = wanted.get(text.strip())
            if j is not None:
                groups[j].append(i)
        if not any(groups):
            raise ValueError(
                f"the simulator's tokenizer spells none of {list(wanted)} as one token: its answers cannot be read"
            )
        return groups

    def generate(self, starts: list[list[int]], max_new_tokens: int, batch_size: int) -> list[str]:
        """Greedy continuations of ``starts``, batched with left padding."""
        import transformers

        if not callable(getattr(self.model, "generate", None)):
            raise TypeError(f"the explainer's model must be a HuggingFace causal LM with .generate; got {self.model}")
        config = transformers.GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad, eos_token_id=self.eos
        )
        replies: list[str] = []
        with kept_state(self.model), torch.no_grad():
            for first in range(0, len(starts), batch_size):
                chunk = starts[first : first + batch_size]
                ids, mask = _padded(chunk, self.pad, left=True)
                width = ids.shape[1]
                generate = cast(Callable[..., torch.Tensor], self.model.generate)
                out = generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config
                )
                for row in out[:, width:].tolist():
                    if self.eos is not None and self.eos in row:
                        row = row[: row.index(self.eos)]
                    replies.append(str(self.tokenizer.decode(row, skip_special_tokens=True)))
        return replies

    def read(
        self, sequences: list[list[int]], slots: list[list[int]], groups: list[list[int]], batch_size: int
    ) -> list[torch.Tensor]:
        """Per sequence, ``(len(slots), len(groups))`` float64: each group's next-token probability at each slot."""
        flat = torch.tensor([i for g in groups for i in g], dtype=torch.long)
        owner = torch.tensor([j for j, g in enumerate(groups) for _ in g], dtype=torch.long)
        out: list[torch.Tensor] = []
        with kept_state(self.model), torch.no_grad():
            for first in range(0, len(sequences), batch_size):
                chunk = sequences[first : first + batch_size]
                ids, mask = _padded(chunk, self.pad, left=False)
                result = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
                logits = result.logits if hasattr(result, "logits") else result
                for r in range(len(chunk)):
                    where = torch.tensor(slots[first + r], dtype=torch.long, device=logits.device)
                    p = logits[r, where].double().softmax(-1)[:, flat.to(logits.device)].cpu()
                    out.append(torch.zeros(len(where), len(groups), dtype=torch.float64).index_add_(1, owner, p))
        return out


def _simulation_ids(lm: _LM, explanation: str, tokens: Sequence[str]) -> tuple[list[int], list[int]]:
    """The all-at-once simulation sequence and its slots (the last id before each token's placeholder)."""
    ids = lm.start(SIMULATION_PROMPT.format(explanation=explanation), "")
    slots = []
    for token in tokens:
        ids += lm.encode(f"{token}\t")
        slots.append(len(ids) - 1)
        ids += lm.encode("?\n")
    return ids, slots


def _padded(rows: list[list[int]], pad: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention mask)`` of token lists padded to one width with ``pad``, on the left or on the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        place = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, place] = torch.tensor(r, dtype=torch.long)
        mask[i, place] = 1
    return ids, mask
