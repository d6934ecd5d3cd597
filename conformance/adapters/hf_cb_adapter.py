"""transformers' continuous batching (``paged|sdpa``): a second paged engine that runs on a CPU.

Driven like nanovllm/bench/peers.py: ``continuous_batching_context_manager`` + ``add_request``
(per-request ``max_new_tokens`` and EOS ids) + ``get_result``. Limits of this adapter, all named
in ``capabilities``: sampling settings are per manager, so requests are grouped by their
(temperature, top_k, top_p, min_p) and each group runs in its own manager session (a batch
mixing greedy and sampled requests is split); no per-request seeds, no top-k or prompt logprobs,
no stop strings or min_tokens, no cached-token counter. Preemptions are counted by wrapping
the engine's ``OffloadingManager.offload_requests`` (requests it takes off the active set).
Text is decoded by the adapter (the engine returns token ids).
"""

from __future__ import annotations

import os
import threading

import torch

from conformance.adapters.base import C, EngineAdapter, Result, Sampling

_lock = threading.Lock()
_offloaded = [0]
_patched = [False]


def _count_offloads() -> None:
    """Wrap OffloadingManager.offload_requests once per process to count preempted requests."""
    with _lock:
        if _patched[0]:
            return
        from transformers.generation.continuous_batching import offloading_manager as om

        orig = om.OffloadingManager.offload_requests

        def offload_requests(self):
            before = len(self.scheduler.active_requests)
            ok = orig(self)
            _offloaded[0] += max(0, before - len(self.scheduler.active_requests))
            return ok

        om.OffloadingManager.offload_requests = offload_requests  # type: ignore[method-assign]
        _patched[0] = True


class HFContinuousBatchingAdapter(EngineAdapter):
    name = "hf-cb"
    capabilities = frozenset(
        {
            C.GREEDY,
            C.SAMPLING,
            C.TOP_K,
            C.TOP_P,
            C.MIN_P,
            C.STOP_TOKEN_IDS,
            C.EOS,
            C.IGNORE_EOS,
            C.TEXT,
            C.PREEMPTION_STATS,
            C.ANY_MODEL,
            C.BLOCK_SIZE,
            C.KV_BUDGET,
            C.CHUNK_BUDGET,
            C.PREFIX_CACHE,
            C.MAX_NUM_SEQS,
        }
    )
    preferred_block_size = 16
    max_live = 2  # each engine holds a model and sizes a KV cache from host memory

    def __init__(self):
        self.model = self.tokenizer = None
        self.knobs: dict = {}
        self._start_offloaded = 0

    @staticmethod
    def describe() -> str:
        import transformers

        return f"transformers {transformers.__version__} continuous batching (paged|sdpa) (torch {torch.__version__})"

    def load(self, model_dir: str, **knobs) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.check_knobs(knobs)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: torch.float32}[knobs.get("dtype")]
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="paged|sdpa"
        ).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            self.tokenizer = None
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.knobs = knobs
        _count_offloads()
        self._start_offloaded = _offloaded[0]

    def _cb_config(self):
        from transformers import ContinuousBatchingConfig

        k = self.knobs
        # on a CPU the cache is sized from host memory; the suite's workloads need little of it
        cfg = {
            "seed": k.get("seed") or 0,
            "max_memory_percent": float(os.environ.get("CONFORMANCE_HF_CB_MEMORY_PERCENT", "0.05")),
        }
        if k.get("block_size") is not None:
            cfg["page_size"] = k["block_size"]
        if k.get("kv_blocks") is not None:
            cfg["num_blocks"] = k["kv_blocks"]
        budget = k.get("max_batched_tokens")
        if k.get("chunked_prefill") is False or budget == float("inf"):
            budget = 4096  # larger than any prompt of the suite: prompts are never split
        if budget is not None:
            cfg["max_batch_tokens"] = int(budget)
        if k.get("prefix_cache") is not None:
            cfg["allow_block_sharing"] = k["prefix_cache"]
        if k.get("max_num_seqs") is not None:
            cfg["max_requests_per_batch"] = k["max_num_seqs"]
        return ContinuousBatchingConfig(**cfg)

    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        self.check_params(params)
        results: list[Result | None] = [None] * len(prompts)
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
        for (temp, top_k, top_p, min_p), members in groups.items():
            for i, r in zip(
                members,
                self._run_group([prompts[i] for i in members], [params[i] for i in members], temp, top_k, top_p, min_p),
            ):
                results[i] = r
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _run_group(self, prompts, params, temp, top_k, top_p, min_p) -> list[Result]:
        from transformers import GenerationConfig

        sample = temp > 0
        gen = GenerationConfig(
            do_sample=sample,
            max_new_tokens=max(p.max_tokens for p in params),
            eos_token_id=-1,
            pad_token_id=0,
            temperature=temp if sample else None,
            top_k=(top_k or None) if sample else None,
            top_p=top_p if sample else None,
            min_p=(min_p or None) if sample else None,
        )
        stop_lists = []
        with self.model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=600, continuous_batching_config=self._cb_config()
        ) as m:
            ids = []
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                stops = list(dict.fromkeys(list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)))
                stop_lists.append(stops)
                ids.append(
                    m.add_request(
                        list(prompt), request_id=f"r{i}", max_new_tokens=p.max_tokens, eos_token_id=stops or -1
                    )
                )
            done: dict = {}
            while len(done) < len(ids):
                r = m.get_result(timeout=1)
                if r is not None and r.is_finished():
                    done[r.request_id] = r
                elif r is None and not m.is_running():
                    raise RuntimeError("transformers continuous batching stopped before finishing")
        out = []
        for rid, p, stops in zip(ids, params, stop_lists):
            r = done[rid]
            if r.error:
                raise RuntimeError(f"request {rid} failed in transformers continuous batching: {r.error}")
            toks = list(r.generated_tokens)
            finish, stop_reason = "length", None
            if toks and toks[-1] in stops:
                finish = "stop"
                stop_reason = toks[-1] if toks[-1] in p.stop_token_ids else None
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer else None
            out.append(Result(toks, finish, text, stop_reason))
        return out

    def stats(self) -> dict:
        return {"preemptions": _offloaded[0] - self._start_offloaded}

    def close(self) -> None:
        self.model = None
