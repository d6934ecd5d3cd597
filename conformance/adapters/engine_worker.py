"""Runs inside vLLM's own Python (its virtual environment): ``python engine_worker.py vllm``.
Imports nothing from this repository.

Protocol: one JSON object per line on stdin, one reply per line on the file descriptor given
in $CONFORMANCE_REPLY_FD (stdout is pointed at stderr so library prints cannot corrupt it).

    {"op": "load", "model": DIR, "knobs": {...}}         -> {"ok": true, "version": ...}
    {"op": "generate", "prompts": [[ids]], "params": [{...}]} -> {"ok": true, "results": [...]}
    {"op": "stats"}                                       -> {"ok": true, "stats": {...}}
    {"op": "close"}                                       -> exits
Errors: {"ok": false, "type": "ValueError", "error": "...", "unsupported": CAPABILITY or null}.
"""

import json
import os
import sys
import traceback


class Unsupported(Exception):
    def __init__(self, capability, detail=""):
        super().__init__(detail or capability)
        self.capability = capability


def _lp_dicts(entries):
    if entries is None:
        return None
    out = []
    for d in entries:
        if d is None:
            out.append(None)
        else:
            out.append({str(t): [lp.logprob, getattr(lp, "rank", None)] for t, lp in d.items()})
    return out


class VLLMBackend:
    def __init__(self):
        import vllm

        self.version = f"vllm {vllm.__version__}"
        self.llm = None

    def load(self, model, knobs):
        from vllm import LLM

        if knobs.get("tp") not in (None, 1):
            raise Unsupported("tp", "the adapter runs vLLM in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        if knobs.get("cuda_graph"):
            raise Unsupported("cuda_graph", "CPU build")
        args = {
            "model": model,
            "dtype": knobs.get("dtype") or "float32",
            "seed": knobs.get("seed") or 0,
            "disable_log_stats": False,
            # on the CPU build this is the share of host memory vLLM reserves (the KV cache lives there)
            "gpu_memory_utilization": float(os.environ.get("CONFORMANCE_VLLM_MEMORY_UTILIZATION", "0.15")),
        }
        if os.environ.get("CONFORMANCE_VLLM_COMPILE", "0") != "1":
            # eager: torch.compile of every new model shape costs minutes on a CPU; the scheduler,
            # KV cache and sampler under test are the same
            args["enforce_eager"] = True
            args["compilation_config"] = {"mode": 0}
        if knobs.get("block_size") is not None:
            args["block_size"] = knobs["block_size"]
        if knobs.get("kv_blocks") is not None:
            args["num_gpu_blocks_override"] = knobs["kv_blocks"]
        if knobs.get("max_model_len") is not None:
            args["max_model_len"] = knobs["max_model_len"]
        if knobs.get("max_num_seqs") is not None:
            args["max_num_seqs"] = knobs["max_num_seqs"]
        if knobs.get("prefix_cache") is not None:
            args["enable_prefix_caching"] = knobs["prefix_cache"]
        budget = knobs.get("max_batched_tokens")
        if knobs.get("chunked_prefill") is False:
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = args.get("max_model_len", 4096)
        elif budget is not None:
            args["enable_chunked_prefill"] = True
            args["max_num_batched_tokens"] = int(budget)
            # vLLM requires max_num_batched_tokens >= max_num_seqs
            args["max_num_seqs"] = min(args.get("max_num_seqs", 256), int(budget))
        try:
            self.llm = LLM(**args)
        except ValueError as e:
            if "block size" in str(e).lower():
                raise Unsupported("block_size", str(e)) from e
            raise

    def generate(self, prompts, params):
        from vllm import SamplingParams, TokensPrompt

        sps = []
        for p in params:
            sps.append(
                SamplingParams(
                    temperature=p["temperature"],
                    top_k=p["top_k"] or 0,
                    top_p=p["top_p"],
                    min_p=p["min_p"],
                    seed=p["seed"],
                    max_tokens=p["max_tokens"],
                    min_tokens=p["min_tokens"],
                    stop=list(p["stop"]),
                    stop_token_ids=list(p["stop_token_ids"]),
                    ignore_eos=p["ignore_eos"],
                    include_stop_str_in_output=p["include_stop_str_in_output"],
                    logprobs=p["logprobs"],
                    prompt_logprobs=p["prompt_logprobs"],
                )
            )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(x)) for x in prompts], sps, use_tqdm=False)
        results = []
        for o in outs:
            c = o.outputs[0]
            results.append(
                {
                    "token_ids": list(c.token_ids),
                    "finish_reason": c.finish_reason,
                    "text": c.text,
                    "stop_reason": c.stop_reason,
                    "logprobs": _lp_dicts(c.logprobs),
                    "prompt_logprobs": _lp_dicts(o.prompt_logprobs),
                    "num_cached_tokens": getattr(o, "num_cached_tokens", None),
                }
            )
        return results

    def stats(self):
        out = {}
        try:
            for m in self.llm.get_metrics():
                if m.name in ("vllm:num_preemptions", "vllm:num_preemptions_total"):
                    out["preemptions"] = int(m.value)
                elif m.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total"):
                    out["cached_tokens"] = int(m.value)
                elif m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total"):
                    out["cache_query_tokens"] = int(m.value)
        except Exception as e:  # noqa: BLE001 - metrics are optional
            out["metrics_error"] = repr(e)
        return out


def main():
    reply_fd = int(os.environ["CONFORMANCE_REPLY_FD"])
    reply = os.fdopen(reply_fd, "w", buffering=1)
    os.dup2(2, 1)  # library output goes to stderr
    backend = None

    def send(obj):
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "close":
                send({"ok": True})
                break
            if backend is None:
                backend = VLLMBackend()
            if op == "load":
                backend.load(msg["model"], msg["knobs"])
                send({"ok": True, "version": backend.version})
            elif op == "generate":
                send({"ok": True, "results": backend.generate(msg["prompts"], msg["params"])})
            elif op == "stats":
                send({"ok": True, "stats": backend.stats()})
            elif op == "version":
                send({"ok": True, "version": backend.version})
            else:
                send({"ok": False, "type": "ValueError", "error": f"unknown op {op!r}"})
        except Unsupported as e:
            send({"ok": False, "type": "Unsupported", "error": str(e), "unsupported": e.capability})
        except Exception as e:  # noqa: BLE001 - reported to the adapter
            traceback.print_exc()
            send({"ok": False, "type": type(e).__name__, "error": str(e)})


if __name__ == "__main__":
    main()
