"""llama.cpp through llama-cpp-python, in this process, on a model's own GGUF file.

llama.cpp loads GGUF files only: a check's model directory is matched to the GGUF it was
converted from (``conformance.models.gguf_source``); a zoo model (an HF directory with float32
safetensors) is exported to a float32 GGUF file once (``conformance.gguf_export``), and its text
is decoded with the directory's own tokenizer (the exported vocabulary is a stand-in for token
ids). The default model's GGUF is quantized (Q4_1): llama.cpp
computes with the quantized weights (and quantized activations in its dot products) while the
reference ran transformers on the dequantized weights, so greedy divergences at margins larger
than float32's delta are expected. The suite's delta for it is ``GGUF_Q4_DELTA`` in
conformance/compare.py, set from measured margins (docs/conformance/llama-cpp.md).

One ``Llama`` holds one sequence: requests of a ``generate`` call run one after another, through
``Llama.generate`` (llama.cpp's own samplers: greedy at temperature 0, else top-k -> typical ->
top-p -> min-p -> temperature -> a seeded draw). ``repeat_penalty`` is 1 (off). The KV cache is
float32 when the check asks for dtype float32 (llama.cpp's default is float16). llama-cpp-python
reuses the longest common prefix of the previous request's KV cache: that is its prefix cache,
always on. Logprobs are the log-softmax of the raw logits (``logits_all=True``); stop strings,
stop ids and EOS end a request where the adapter sees them (vLLM's rules). Not supported:
min_tokens (llama-cpp-python's logits processors are not wired to its sampler), engine knobs.
"""

from __future__ import annotations

import os
import random

import numpy as np

from conformance.adapters.base import C, EngineAdapter, Logprob, Result, Sampling, Unsupported, cut_at_stop_string
from conformance.gguf_export import f32_gguf
from conformance.models import gguf_source

GGML_TYPE_F32 = 0


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    m = row.max()
    return row - m - np.log(np.exp(row - m).sum())


def logprob_entry(lps: np.ndarray, token: int, k: int) -> dict[int, Logprob]:
    """{token: Logprob} for the top-k of a log-softmax row plus ``token``, ranks 1-based."""
    out: dict[int, Logprob] = {}
    if k:
        top = np.argpartition(-lps, k)[:k]
        for rank, t in enumerate(sorted(top.tolist(), key=lambda t: -lps[t]), start=1):
            out[t] = Logprob(float(lps[t]), rank)
    if token not in out:
        out[token] = Logprob(float(lps[token]), int((lps > lps[token]).sum()) + 1)
    return out


def context_length(gguf_path: str) -> int:
    """The context the GGUF file declares (``<arch>.context_length``)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.context_length"].contents())


def generation_eos_ids(model_dir: str) -> list[int]:
    """The EOS ids of an HF directory's generation_config.json ([] when there is none)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def file_arithmetic(file_type) -> str | None:
    """None for float32 weights; else "gguf <file type>" (e.g. "gguf MOSTLY_Q4_1"): the
    comparison rules take the delta measured for that quantization (conformance.compare)."""
    from gguf import LlamaFileType

    ft = LlamaFileType(int(file_type or 0))
    return None if ft == LlamaFileType.ALL_F32 else f"gguf {ft.name}"


class LlamaCppAdapter(EngineAdapter):
    name = "llama-cpp"
    max_live = 2
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
            C.EOS,
            C.IGNORE_EOS,
            C.TEXT,
            C.TOKEN_IDS,
            C.ANY_MODEL,
        }
    )

    def __init__(self, **llama_args):
        self.llm = None
        self._rng = random.Random(0)
        self.llama_args = llama_args  # extra Llama(...) arguments (scripts/quantized_margins.py's wrong engine)

    @classmethod
    def unavailable(cls) -> str | None:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed in this Python (pip install llama-cpp-python)"
        return None

    @classmethod
    def describe(cls) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__} (llama.cpp, CPU, in process)"

    def load(self, model_dir: str, **knobs) -> None:
        from llama_cpp import Llama

        self.check_knobs(knobs)
        gguf = gguf_source(model_dir)
        self.tokenizer = None
        if gguf is None:
            try:
                gguf = f32_gguf(model_dir)
            except (OSError, ValueError, KeyError) as e:
                raise Unsupported(
                    C.ANY_MODEL,
                    f"llama.cpp loads GGUF files; {model_dir} has none and cannot "
                    f"be exported ({type(e).__name__}: {e})",
                ) from None
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        f32 = knobs.get("dtype") in (None, "float32")
        threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        # the context: the model's own (max_position_embeddings), capped to keep logits_all small
        n_ctx = min(int(os.environ.get("CONFORMANCE_LLAMA_CPP_N_CTX", "1024")), context_length(gguf))
        self.context = n_ctx  # llama.cpp pads n_ctx up (to 256): the limit is the model's
        self.llm = Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            logits_all=True,
            seed=int(knobs.get("seed") or 0),
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **({"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32 else {}),
            **self.llama_args,
        )
        self._rng = random.Random(knobs.get("seed") or 0)
        self.eos = self.llm.token_eos()
        # every EOS id of the model: generation_config.json's list where there is one (an HF
        # directory), else the GGUF's own
        self.eos_ids = {self.eos} | set(generation_eos_ids(model_dir))
        self.gguf = gguf
        self.arithmetic = file_arithmetic(self.llm.metadata.get("general.file_type"))

    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        self.check_params(params)
        return [self._one(list(prompt), p) for prompt, p in zip(prompts, params)]

    def _one(self, prompt: list[int], p: Sampling) -> Result:
        llm = self.llm
        if len(prompt) >= self.context:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {self.context} tokens")
        if len(prompt) + p.max_tokens > self.context:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens {p.max_tokens} exceeds the context of "
                f"{self.context} tokens"
            )
        llm.set_seed(p.seed if p.seed is not None else self._rng.getrandbits(31))
        toks: list[int] = []
        finish, stop_reason, text = "length", None, None
        if p.max_tokens > 0:
            for tok in llm.generate(
                prompt,
                temp=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                min_p=p.min_p,
                typical_p=1.0,
                repeat_penalty=1.0,
                reset=True,
            ):
                toks.append(int(tok))
                if tok in p.stop_token_ids:
                    finish, stop_reason = "stop", int(tok)
                    break
                if tok in self.eos_ids and not p.ignore_eos:
                    finish = "stop"
                    break
                if p.stop:
                    cut, hit = cut_at_stop_string(self._text(toks), p.stop, p.include_stop_str_in_output)
                    if hit is not None:
                        finish, stop_reason, text = "stop", hit, cut  # type: ignore[assignment]
                        break
                if len(toks) >= p.max_tokens:
                    break
        if text is None:
            text = self._text(toks)
        n = len(prompt)
        # scores row i holds the logits after token i (they predict token i + 1)
        rows = llm.scores[: n + len(toks)]
        logprobs = None
        if p.logprobs is not None:
            logprobs = [logprob_entry(log_softmax(rows[n - 1 + t]), tok, p.logprobs) for t, tok in enumerate(toks)]
        prompt_lps = None
        if p.prompt_logprobs is not None:
            prompt_lps = [None] + [
                logprob_entry(log_softmax(rows[i - 1]), prompt[i], p.prompt_logprobs) for i in range(1, n)
            ]
        return Result(
            token_ids=toks,
            finish_reason=finish,
            text=text,
            stop_reason=stop_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
        )

    def _text(self, toks: list[int]) -> str:
        if self.tokenizer is not None:  # an exported zoo model: its own tokenizer has the text
            return self.tokenizer.decode(toks, skip_special_tokens=True)  # type: ignore[return-value]
        # the stop token itself (EOS and other special tokens) is not text, as in vLLM
        special = self.eos_ids
        return self.llm.detokenize([t for t in toks if t not in special]).decode("utf-8", errors="replace")

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
