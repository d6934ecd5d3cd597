"""nanovllm through its public API: ``LLM(...)``, ``LLM.generate``, ``LLM.stats()``.

The only module of the suite that imports nanovllm (a test enforces it): the suite itself is
engine-agnostic and checks nanovllm the way it checks any other engine."""

from __future__ import annotations

from conformance.adapters.base import C, EngineAdapter, Logprob, Result, Sampling

_KNOBS = {
    "block_size": "block_size",
    "kv_blocks": "num_kvcache_blocks",
    "kv_cache_gib": "kv_cache_memory_gib",
    "max_batched_tokens": "max_num_batched_tokens",
    "chunked_prefill": "enable_chunked_prefill",
    "prefix_cache": "enable_prefix_caching",
    "tp": "tensor_parallel_size",
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "seed": "seed",
    "dtype": "dtype",
    "device": "device",
    "async_scheduling": "async_scheduling",
}


def rows_linear_on() -> bool:
    """Whether this process's CPU engine multiplies float32 weights with the rows kernel (built with
    AVX-512, not switched off): the source of its batch invariance."""
    from nanovllm.layers import cpu_linear

    return cpu_linear.rows_enabled()


def _logprob_dicts(entries) -> list | None:
    if entries is None:
        return None
    return [None if d is None else {t: Logprob(lp.logprob, lp.rank) for t, lp in d.items()} for d in entries]


class NanovllmAdapter(EngineAdapter):
    name = "nanovllm"

    def __init__(self):
        import torch

        caps = {
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
            C.PREFIX_CACHE_STATS,
            C.PREEMPTION_STATS,
            C.ADMISSION_CONTROL,
            C.ANY_MODEL,
            C.BLOCK_SIZE,
            C.KV_BUDGET,
            C.CHUNK_BUDGET,
            C.PREFIX_CACHE,
            C.MAX_NUM_SEQS,
            C.MAX_MODEL_LEN,
            C.ASYNC_SCHEDULING,
            C.TP,
        }
        if torch.cuda.is_available():
            caps.add(C.CUDA_GRAPH)
        elif rows_linear_on():  # the CPU path's claim (float32: the rows kernel sums each row's products in
            # one order whatever its batch); not made where oneDNN multiplies float32 (no AVX-512, or the
            # kernel switched off), whose order may follow the batch size on some machines, nor on a CUDA
            # host, even for --device cpu there, as CUDA's cuBLAS products do not keep it
            caps.add(C.BATCH_INVARIANT)
        self.capabilities = frozenset(caps)
        self.llm = None
        self.version = __import__("nanovllm").__version__

    @staticmethod
    def describe() -> str:
        import torch

        import nanovllm

        return f"nanovllm {nanovllm.__version__} (torch {torch.__version__})"

    def load(self, model_dir: str, **knobs) -> None:
        from nanovllm import LLM

        self.check_knobs(knobs)
        args = {_KNOBS[k]: v for k, v in knobs.items() if v is not None and k in _KNOBS}
        if knobs.get("cuda_graph") is not None:
            args["enforce_eager"] = not knobs["cuda_graph"]
        if args.get("max_num_batched_tokens") == float("inf"):
            del args["max_num_batched_tokens"]
            args["enable_chunked_prefill"] = False
        self.llm = LLM(model_dir, **args)

    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        from nanovllm import SamplingParams

        self.check_params(params)
        sps = [
            SamplingParams(
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                min_p=p.min_p,
                seed=p.seed,
                max_tokens=p.max_tokens,
                min_tokens=p.min_tokens,
                stop=list(p.stop),
                stop_token_ids=list(p.stop_token_ids),
                ignore_eos=p.ignore_eos,
                include_stop_str_in_output=p.include_stop_str_in_output,
                logprobs=p.logprobs,
                prompt_logprobs=p.prompt_logprobs,
            )
            for p in params
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
        results = []
        for out in outs:
            c = out.outputs[0]
            results.append(
                Result(
                    token_ids=list(c.token_ids),
                    finish_reason=c.finish_reason,
                    text=c.text,
                    stop_reason=c.stop_reason,
                    logprobs=_logprob_dicts(c.logprobs),
                    prompt_logprobs=_logprob_dicts(out.prompt_logprobs),
                    num_cached_tokens=out.num_cached_tokens,
                    num_preemptions=out.metrics.num_preemptions if out.metrics is not None else None,
                    extra={"prompt_token_ids": list(out.prompt_token_ids)},
                )
            )
        return results

    def stats(self) -> dict:
        s = self.llm.stats()
        return {"preemptions": s["preemptions"], "cached_tokens": s["prefix_cache_hit_tokens"], **s}

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
