"""Logits processing beyond temperature and the filters, with vLLM's meanings and order:
allowed tokens, logit bias, then the repetition, frequency and presence penalties.

Applied to the float32 logits of the rows that have any (``RowLogitsProcessing``, built by
``build_model_input`` only for those rows), before greedy selection and temperature, in a
few batched tensor operations over those rows (not one per row): each row's token lists are
flattened into (row, token) index pairs. Banned tokens (min_tokens, bad words) are -inf
masks applied by the sampler; every operation here keeps -inf at -inf, so the order of the
masks does not matter.
"""

from __future__ import annotations

import torch

from nanovllm.core.model_input import RowLogitsProcessing


def _pairs(lists: list[tuple[int, list[int]]], device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [i for i, ids in lists for _ in ids]
    tokens = [t for _, ids in lists for t in ids]
    both = torch.tensor([rows, tokens], dtype=torch.int64).to(device, non_blocking=True)
    return both[0], both[1]


def apply_allowed_token_ids(x: torch.Tensor, rows: list[tuple[int, list[int]]]) -> None:
    """Only each listed row's allowed tokens keep their logits; the others become -inf."""
    r, t = _pairs(rows, x.device)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[r, t] = True
    restricted = torch.zeros(x.shape[0], dtype=torch.bool)
    restricted[[i for i, _ in rows]] = True
    x.masked_fill_(~keep & restricted.to(x.device).unsqueeze(1), float("-inf"))


def apply_logit_bias(x: torch.Tensor, rows: list[tuple[int, dict[int, float]]]) -> None:
    """Add each row's bias to its tokens' logits."""
    r, t = _pairs([(i, list(bias)) for i, bias in rows], x.device)
    values = torch.tensor([v for _, bias in rows for v in bias.values()], dtype=x.dtype).to(x.device)
    x.index_put_((r, t), values, accumulate=True)


def apply_penalties(x: torch.Tensor, rows: list[tuple[int, RowLogitsProcessing]]) -> torch.Tensor:
    """vLLM's penalties: repetition_penalty r on every token seen in the prompt or the output
    (a positive logit is divided by r, another multiplied by r); then
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the output."""
    m = x.shape[0]
    counts = torch.zeros_like(x)
    r, t = _pairs([(i, p.output_token_ids or []) for i, p in rows], x.device)
    counts.index_put_((r, t), torch.ones_like(r, dtype=x.dtype), accumulate=True)
    repetition = [(i, p) for i, p in rows if p.repetition_penalty != 1.0]
    if repetition:
        seen = counts > 0
        r, t = _pairs([(i, p.prompt_token_ids or []) for i, p in repetition], x.device)
        seen[r, t] = True
        penalty = [1.0] * m
        for i, p in repetition:
            penalty[i] = p.repetition_penalty
        pen = torch.tensor(penalty, dtype=x.dtype).to(x.device).unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    if any(p.frequency_penalty or p.presence_penalty for _, p in rows):
        freq, pres = [0.0] * m, [0.0] * m
        for i, p in rows:
            freq[i], pres[i] = p.frequency_penalty, p.presence_penalty
        coef = torch.tensor([freq, pres], dtype=x.dtype).to(x.device)
        x = x - coef[0].unsqueeze(1) * counts - coef[1].unsqueeze(1) * (counts > 0).to(x.dtype)
    return x


def apply_logits_processing(logits: torch.Tensor, processing: dict[int, RowLogitsProcessing]) -> torch.Tensor:
    """float32 logits [n, vocab] -> the same tensor with the processed rows rewritten."""
    if not processing:
        return logits
    index = sorted(processing)
    params = [processing[r] for r in index]
    rows = torch.tensor(index, dtype=torch.int64).to(logits.device, non_blocking=True)
    x = logits.index_select(0, rows)
    allowed = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:
        apply_allowed_token_ids(x, allowed)
    bias = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if bias:
        apply_logit_bias(x, bias)
    penalized = [(i, p) for i, p in enumerate(params) if p.output_token_ids is not None]
    if penalized:
        x = apply_penalties(x, penalized)
    logits.index_copy_(0, rows, x)
    return logits
