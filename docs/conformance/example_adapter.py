"""A complete small adapter: a naive engine that runs a transformers model with no KV cache,
one full forward pass per generated token. WRITING_AN_ADAPTER.md walks through it; CI checks it.

    PYTHONPATH=docs/conformance python -m conformance --adapter example_adapter:NaiveAdapter
"""

from __future__ import annotations

import torch

from conformance.adapters.base import C, EngineAdapter, Logprob, Result, Sampling


class NaiveAdapter(EngineAdapter):
    name = "naive"
    # what this engine can do; checks that need anything else are skipped with its name
    capabilities = frozenset(
        {
            C.GREEDY,
            C.LOGPROBS,
            C.PROMPT_LOGPROBS,
            C.STOP_TOKEN_IDS,
            C.EOS,
            C.IGNORE_EOS,
            C.TEXT,
            C.TOKEN_IDS,
            C.ANY_MODEL,
        }
    )

    @classmethod
    def describe(cls) -> str:
        return f"naive full-recompute decoding over transformers (torch {torch.__version__})"

    def load(self, model_dir: str, **knobs) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.check_knobs(knobs)  # refuses knobs this engine lacks (block_size, kv_blocks, ...)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        self.check_params(params)  # refuses requests that need a capability it lacks
        return [self._one(list(prompt), p) for prompt, p in zip(prompts, params)]

    def _one(self, prompt: list[int], p: Sampling) -> Result:
        ids, logprobs, finish, stop_reason = list(prompt), [], "length", None
        for _ in range(p.max_tokens):
            row = torch.log_softmax(self.model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            tok = int(row.argmax())
            ids.append(tok)
            logprobs.append(_entry(row, tok, p.logprobs or 0))
            if tok in p.stop_token_ids:
                finish, stop_reason = "stop", tok
                break
            if tok in self.eos_ids and not p.ignore_eos:
                finish = "stop"
                break
        out = ids[len(prompt) :]
        prompt_lps = None
        if p.prompt_logprobs is not None:
            rows = torch.log_softmax(self.model(torch.tensor([prompt])).logits[0].float(), dim=-1)
            prompt_lps = [None] + [_entry(rows[i - 1], prompt[i], p.prompt_logprobs) for i in range(1, len(prompt))]
        return Result(
            token_ids=out,
            finish_reason=finish,
            stop_reason=stop_reason,
            text=self.tokenizer.decode(out, skip_special_tokens=True),
            logprobs=logprobs if p.logprobs is not None else None,
            prompt_logprobs=prompt_lps,
        )


def _entry(row: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The top-k of a log-softmax row with 1-based ranks, plus ``token`` with its own rank."""
    entry = {}
    if k:
        values, ids = row.topk(k)
        entry = {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids.tolist(), values.tolist()), start=1)}
    if token not in entry:
        entry[token] = Logprob(float(row[token]), int((row > row[token]).sum()) + 1)
    return entry
