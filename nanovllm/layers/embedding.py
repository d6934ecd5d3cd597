"""Vocabulary-parallel embedding and LM head. The vocabulary need not divide evenly:
each rank holds ceil(vocab / tp) rows, the last rank's tail is zero padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.core.utils import cdiv
from nanovllm.layers import cpu_linear
from nanovllm.layers.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_size
from nanovllm.loader.model_loader import set_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows_per_rank = cdiv(vocab_size, tp_size())
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(loaded.shape)} does not match the model's {expected}"
            )
        n = self.vocab_end - self.vocab_start
        if n == param.shape[0]:  # no padding rows (one rank, or a vocabulary that divides evenly)
            set_weight(param, loaded[self.vocab_start : self.vocab_end])
            return
        param.data[n:].zero_()
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        return all_reduce(y * mask.unsqueeze(-1).to(y.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary on every rank (each rank computes its slice)."""

    packed_weight: torch.Tensor | cpu_linear.RowsWeight | None = None  # packed copy on CPU (cpu_linear.py)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_linear.linear(hidden, self.weight, None, self.packed_weight)
        if tp_size() > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
