"""Sampler: logits of the rows that sample -> token ids (+ top-k logprobs).

Order, as in vLLM: ban stop tokens while min_tokens is not reached and bad words;
apply the rows' other logits processing (allowed tokens, logit bias, penalties:
``logits_processing.py``); greedy rows take the argmax; random rows divide by the temperature, then apply min_p, top_k
and top_p, and draw with the exponential race (argmax of p / E, E ~ Exp(1)),
which samples exactly from p and never picks a token of probability 0.
Each seeded request draws its noise from its own generator, so its tokens do
not depend on its batch-mates. Logprobs are those of the raw model distribution.

On a GPU, when the runner gives per-row Philox seeds (``row_seeds``), the rows
without filters, bans or logits processing are sampled by one fused kernel
(``fused_sampler``: the Gumbel-max draw, the same distribution) and only the other
rows take the PyTorch path, each seeded by its row seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanovllm import cpu_kernels
from nanovllm.core.model_input import RowLogitsProcessing
from nanovllm.core.model_output import SamplerOutput
from nanovllm.layers.logits_processing import apply_logits_processing
from nanovllm.layers.triton_switch import LazyKernels

fused_sampler = LazyKernels("nanovllm.layers.fused_sampler", "NANOVLLM_FUSED_SAMPLER")  # Triton only when used


@dataclass
class SamplingMetadata:
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    banned_token_ids: list[list[int]]  # per row (min_tokens not reached yet)
    num_logprobs: list[int | None]  # per row
    # GPU fused path: a 62-bit Philox seed per row (seeded requests: from their seed and
    # output index; others: from the engine's seed and step), and which rows are seeded
    row_seeds: list[int] | None = None
    seeded: list[bool] | None = None
    # row -> allowed tokens, logit bias, penalties (only the rows that have some)
    processing: dict[int, RowLogitsProcessing] = field(default_factory=dict)
    greedy: list[bool] = field(init=False)

    def __post_init__(self):
        self.greedy = [t < 1e-5 for t in self.temperatures]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens (0 = all), then the smallest set of the most
    likely tokens whose probability reaches top_p (always at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class PendingSample:
    """A launched sampling step: ``tokens`` is on the device now (a later step may read it
    there); ``result()`` brings everything to the host (the step's one synchronisation)."""

    def __init__(self, tokens: torch.Tensor, finish):
        self.tokens = tokens
        self._finish = finish

    def result(self) -> SamplerOutput:
        return self._finish()


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        return self.launch(logits, meta).result()

    def launch(self, logits: torch.Tensor, meta: SamplingMetadata) -> PendingSample:
        if meta.row_seeds is not None and fused_sampler.enabled(logits):
            return self._fused(logits, meta)
        if meta.row_seeds is not None:  # fused kernel off: the seeded rows draw from their row seeds
            assert meta.seeded is not None  # set with row_seeds
            meta.generators = [
                torch.Generator(device=logits.device).manual_seed(s) if seeded else None
                for s, seeded in zip(meta.row_seeds, meta.seeded)
            ]
        logits = logits.float()
        n = logits.shape[0]
        want_logprobs = any(k is not None for k in meta.num_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        # rows with NaN/inf are reported (the engine ends those requests); what they sample is discarded
        if _plain_greedy(meta) and cpu_kernels.elementwise_applies(logits):
            tokens, finite = cpu_kernels.greedy(logits)  # one pass per row instead of five operators
        else:
            finite = torch.isfinite(logits).all(dim=-1)
            tokens = self._choose(logits, meta)

        def finish() -> SamplerOutput:
            nonfinite = (~finite).nonzero().flatten().tolist() if not bool(finite.all()) else []
            logprobs = _logprobs(raw_logprobs, tokens, meta.num_logprobs) if want_logprobs else [None] * n  # type: ignore[arg-type]
            return SamplerOutput(tokens.tolist(), nonfinite, logprobs)

        return PendingSample(tokens, finish)

    def _fused(self, logits: torch.Tensor, meta: SamplingMetadata) -> PendingSample:
        """One kernel for the plain rows; the PyTorch path for rows with filters or bans."""
        n = logits.shape[0]
        device = logits.device
        assert meta.row_seeds is not None and meta.seeded is not None  # launch() takes this path with row seeds
        inv_temp = [0.0 if g else 1.0 / t for g, t in zip(meta.greedy, meta.temperatures)]
        tokens, nonfinite = fused_sampler.sample(
            logits, _to_device(inv_temp, torch.float32, device), _to_device(meta.row_seeds, torch.int64, device)
        )
        special = general_path_rows(meta)
        if special:
            sub = _select(meta, special)
            sub.generators = [
                torch.Generator(device=device).manual_seed(meta.row_seeds[r]) if meta.seeded[r] else None
                for r in special
            ]
            index = _to_device(special, torch.int64, device)
            tokens[index] = self._choose(logits[index].float(), sub)
        want = [i for i, k in enumerate(meta.num_logprobs) if k is not None]
        raw = None
        if want:
            index = _to_device(want, torch.int64, device)
            raw = torch.log_softmax(logits[index].float(), dim=-1), tokens[index]
        both = torch.stack((tokens, nonfinite))
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=both.is_cuda)
        host.copy_(both, non_blocking=True)
        done = torch.cuda.Event() if both.is_cuda else None
        if done is not None:
            done.record()

        def finish() -> SamplerOutput:
            if done is not None:
                done.synchronize()
            token_list, flags = host.tolist()
            logprobs: list = [None] * n
            if raw is not None:
                rows = _logprobs(raw[0], raw[1], [meta.num_logprobs[i] for i in want])
                for i, entry in zip(want, rows):
                    logprobs[i] = entry
            return SamplerOutput(token_list, [i for i, f in enumerate(flags) if f], logprobs)

        return PendingSample(tokens, finish)

    def _choose(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """float32 logits -> sampled token ids (a device tensor)."""
        n = logits.shape[0]
        if any(meta.banned_token_ids) or meta.processing:
            logits = logits.clone()
            for row, banned in enumerate(meta.banned_token_ids):
                if banned:
                    logits[row, banned] = float("-inf")
            logits = apply_logits_processing(logits, meta.processing)

        random_rows = [i for i, g in enumerate(meta.greedy) if not g]
        if len(random_rows) == n:  # no greedy row: sample every row without gathering them
            tokens = self._sample(logits, meta, random_rows)
        else:
            tokens = logits.argmax(dim=-1)
            if random_rows:
                tokens[random_rows] = self._sample(logits[random_rows], meta, random_rows)
        return tokens

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        device = logits.device
        temps = [meta.temperatures[r] for r in rows]
        if len(set(temps)) == 1:  # one temperature for all: a scalar, no host->device copy
            logits = logits / temps[0]
        else:
            logits = logits / torch.tensor(temps, device=device, dtype=torch.float32).unsqueeze(1)
        min_ps = [meta.min_ps[r] for r in rows]
        if any(p > 0 for p in min_ps):
            logits = apply_min_p(logits, torch.tensor(min_ps, device=device))
        top_ks = [
            min(meta.top_ks[r], logits.shape[-1]) for r in rows
        ]  # k >= the vocabulary keeps all (2**63 overflowed)
        top_ps = [meta.top_ps[r] for r in rows]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = apply_top_k_top_p(
                logits, torch.tensor(top_ks, device=device), torch.tensor(top_ps, device=device, dtype=torch.float32)
            )
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if meta.generators[r] is None]
        if len(shared) == len(rows):
            noise.exponential_(generator=self.generator)
        elif shared:
            noise[shared] = torch.empty((len(shared), probs.shape[1]), device=device).exponential_(
                generator=self.generator
            )
        for i, r in enumerate(rows):
            gen = meta.generators[r]
            if gen is not None:
                noise[i].exponential_(generator=gen)
        # exponential_ can return 0; p / 0 would be inf (or NaN for p = 0)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)


def _plain_greedy(meta: SamplingMetadata) -> bool:
    """Every row greedy, nothing banned, no logits processing: the argmax of the raw logits."""
    return all(meta.greedy) and not any(meta.banned_token_ids) and not meta.processing


def general_path_rows(meta: SamplingMetadata) -> list[int]:
    """The rows the fused kernel cannot sample (it knows temperature only): filtered rows,
    rows with banned tokens, rows with other logits processing."""
    return [
        i
        for i in range(len(meta.temperatures))
        if meta.banned_token_ids[i]
        or i in meta.processing
        or (not meta.greedy[i] and (meta.top_ks[i] > 0 or meta.top_ps[i] < 1.0 or meta.min_ps[i] > 0))
    ]


def _select(meta: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    pick = lambda values: [values[r] for r in rows]  # noqa: E731
    processing = {i: meta.processing[r] for i, r in enumerate(rows) if r in meta.processing}
    return SamplingMetadata(
        pick(meta.temperatures),
        pick(meta.top_ks),
        pick(meta.top_ps),
        pick(meta.min_ps),
        pick(meta.generators),
        pick(meta.banned_token_ids),
        pick(meta.num_logprobs),
        processing=processing,
    )


def _logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> list:
    """Per row: None, or (sampled token's logprob, its rank, top-k [(token, logprob)])."""
    out: list = [None] * len(num_logprobs)
    max_k = max(k for k in num_logprobs if k is not None)
    top_vals, top_ids = raw_logprobs.topk(max(max_k, 1), dim=-1) if max_k else (None, None)
    sampled_lp = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    sampled_rank = (raw_logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
    slp, srank = sampled_lp.tolist(), sampled_rank.tolist()
    tv = top_vals.tolist() if top_vals is not None else None
    ti = top_ids.tolist() if top_ids is not None else None
    for row, k in enumerate(num_logprobs):
        if k is not None:
            out[row] = (slp[row], srank[row], list(zip(ti[row][:k], tv[row][:k])) if k else [])  # type: ignore[index]
    return out


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without synchronising (pinned memory, asynchronous copy)."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=True)
