"""The reference: transformers ``generate`` (one request at a time) + teacher-forced scoring.

Each request runs alone (no padding), so batch-mates cannot change it. Per-step
logprobs are the log-softmax of ``output_logits`` (the raw logits); prompt
logprobs come from one teacher-forced forward over the prompt. transformers has
no stop-string contract (and its ``StopStringCriteria`` cannot index a word-level
vocabulary such as the zoo's): the adapter generates on and cuts tokens and text at the
first stop string the way vLLM defines it (exact: later tokens do not change earlier ones). Identical unseeded requests (the sampling-distribution check)
run as one batch of identical rows: independent samples, no padding.
"""

from __future__ import annotations

import random

import torch

from conformance.adapters.base import C, EngineAdapter, Logprob, Result, Sampling, cut_at_stop_string


def logprob_entry(row: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """{token: Logprob} for the top-k of a log-softmax row plus ``token``, ranks 1-based."""
    out: dict[int, Logprob] = {}
    if k:
        vals, ids = row.topk(k)
        for r, (t, v) in enumerate(zip(ids.tolist(), vals.tolist()), start=1):
            out[t] = Logprob(v, r)
    if token not in out:
        out[token] = Logprob(float(row[token]), int((row > row[token]).sum()) + 1)
    return out


class HFAdapter(EngineAdapter):
    name = "hf"
    capabilities = frozenset(
        {
            C.GREEDY,
            C.SAMPLING,
            C.SEED,
            C.TOP_K,
            C.TOP_P,
            C.MIN_P,
            C.LOGPROBS,
            C.SAMPLED_LOGPROB,
            C.PROMPT_LOGPROBS,
            C.STOP_STRINGS,
            C.STOP_TOKEN_IDS,
            C.MIN_TOKENS,
            C.EOS,
            C.IGNORE_EOS,
            C.TEXT,
            C.ANY_MODEL,
        }
    )

    def __init__(self):
        import transformers

        self.version = transformers.__version__
        self.model = self.tokenizer = None
        self._rng = random.Random(0)

    @staticmethod
    def describe() -> str:
        import transformers

        return f"transformers {transformers.__version__} generate + teacher-forced scoring (torch {torch.__version__})"

    def load(self, model_dir: str, **knobs) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        from conformance.reference import load_hf_model

        self.check_knobs(knobs)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: torch.float32}[knobs.get("dtype")]
        self.model = load_hf_model(model_dir, dtype)
        self._rng = random.Random(knobs.get("seed") or 0)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            self.tokenizer = None
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        eos = self.model.config.eos_token_id if eos is None else eos
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        self.check_params(params)
        results: list[Result | None] = [None] * len(prompts)
        groups: dict[tuple, list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            key = (tuple(prompt), p) if p.seed is None and p.temperature > 0 and not p.stop else (i,)
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            for start in range(0, len(members), 256):
                chunk = members[start : start + 256]
                outs = self._generate_rows(prompts[chunk[0]], params[chunk[0]], len(chunk))
                for i, r in zip(chunk, outs):
                    results[i] = r
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate_rows(self, prompt: list[int], p: Sampling, rows: int) -> list[Result]:
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
        stop_ids = list(dict.fromkeys(stop_ids))
        ids = torch.tensor([prompt] * rows)
        kw = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=p.max_tokens,
            min_new_tokens=p.min_tokens or None,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=stop_ids or None,
        )
        if p.temperature == 0:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(
                do_sample=True, temperature=p.temperature, top_k=p.top_k or None, top_p=p.top_p, min_p=p.min_p or None
            )
        torch.manual_seed(p.seed if p.seed is not None else self._rng.getrandbits(62))
        out = self.model.generate(ids, **kw)
        step_lps = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # [rows, steps, V]
        prompt_lps = self._prompt_logprobs(prompt, p.prompt_logprobs) if p.prompt_logprobs is not None else None
        results = []
        for r in range(rows):
            toks = out.sequences[r, len(prompt) :].tolist()
            # generate pads finished rows; the request ends at its first stop token
            end = next((t + 1 for t, tok in enumerate(toks) if tok in stop_ids and t + 1 >= p.min_tokens), len(toks))
            toks = toks[:end]
            finish, stop_reason = "length", None
            if toks and toks[-1] in stop_ids and len(toks) >= max(p.min_tokens, 1):
                finish = "stop"
                stop_reason = toks[-1] if toks[-1] in p.stop_token_ids else None
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(toks, skip_special_tokens=True)
                if p.stop and finish != "stop":
                    # the request ends at the first token whose text completes a stop string; the
                    # tokens after it were generated from the same context, so cutting is exact
                    for t in range(max(p.min_tokens, 1), len(toks) + 1):
                        part = self.tokenizer.decode(toks[:t], skip_special_tokens=True)
                        cut, hit = cut_at_stop_string(part, p.stop, p.include_stop_str_in_output)
                        if hit is not None:
                            toks, text, finish, stop_reason = toks[:t], cut, "stop", hit
                            break
            logprobs = None
            if p.logprobs is not None:
                logprobs = [logprob_entry(step_lps[r, t], tok, p.logprobs) for t, tok in enumerate(toks)]
            results.append(Result(toks, finish, text, stop_reason, logprobs, prompt_lps))
        return results

    @torch.inference_mode()
    def _prompt_logprobs(self, prompt: list[int], k: int) -> list:
        logits = self.model(torch.tensor([prompt])).logits[0].float()
        lps = torch.log_softmax(logits, dim=-1)
        return [None] + [logprob_entry(lps[pos - 1], prompt[pos], k) for pos in range(1, len(prompt))]

    def close(self) -> None:
        self.model = None
