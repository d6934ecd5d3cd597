"""How far an FP8 KV cache moves nanovllm from the reference, and whether the greedy rule at a
chosen delta still rejects a wrong engine: the data behind conformance.compare's delta and
tolerance for the FP8 KV cache.

    python scripts/kv_fp8_margins.py [--golden smollm2-135m] [--delta 0.3] [--logprob-tol 0.3] [--json out.json]

On the golden cases (transformers float32), for each engine configuration: the 64 greedy tokens
(EOS ignored), the first step where they leave the reference, the reference's margin there (its
logprob of its own token minus its logprob of the engine's; None when the engine's token is
outside the recorded top-5), and the largest prompt-logprob difference. Configurations: float32
weights with the float32 cache (must match exactly), float32 weights with the FP8 cache, and the
bfloat16 engine with its own cache and with FP8 (the yardstick: what bfloat16 arithmetic already
moves). The wrong engine stores K in FP8 at a scale of 0.5 but reads it back at 1.0 (a scale
forgotten on load: every attention score doubled); at --delta it must fail the greedy rule.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

import golden
from conformance.compare import compare_greedy
from conformance.harness import golden_divergence, golden_step_logprobs, margin_shares

CONFIGS = [("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto"), ("bfloat16", "fp8")]


@contextmanager
def scale_forgotten_on_load():
    """The wrong engine: K stored at scale 0.5, read back at 1.0."""
    from nanovllm.attention import torch_ref

    load = torch_ref._load
    torch_ref._load = lambda t, cache_dtype, scale: load(t, cache_dtype, 1.0)
    try:
        yield
    finally:
        torch_ref._load = load


def run(g: dict, dtype: str, kv: str, wrong: bool = False) -> tuple[list, list]:
    from nanovllm import LLM, SamplingParams

    llm = LLM(golden.model_dir(g), device="cpu", dtype=dtype, kv_cache_dtype=kv)
    if wrong:
        for layer in llm.llm_engine.executor.runner.attn_layers:
            layer.k_scale = 0.5
    prompts = [{"prompt_token_ids": c["prompt"]} for c in g["cases"]]
    try:
        with scale_forgotten_on_load() if wrong else _nothing():
            outs = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=g["max_tokens"], ignore_eos=True), use_tqdm=False
            )
            scored = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
            )
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outs], [o.prompt_logprobs for o in scored]


@contextmanager
def _nothing():
    yield


def judge(g: dict, toks: list, plps: list) -> dict:
    return {"cases": [golden_divergence(c, out, plp) for c, out, plp in zip(g["cases"], toks, plps)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--golden", default=golden.SMOLLM)
    ap.add_argument("--delta", type=float, default=None, help="candidate delta for the FP8 cache")
    ap.add_argument("--max-diverged-frac", type=float, default=1.0)
    ap.add_argument("--logprob-tol", type=float, default=None, help="candidate prompt-logprob tolerance")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    g = golden.load(args.golden)
    refs, ref_lps = [c["greedy"] for c in g["cases"]], [golden_step_logprobs(c) for c in g["cases"]]
    result: dict = {"golden": args.golden, "configs": {}}
    runs = {}
    for dtype, kv in CONFIGS + [("float32", "wrong")]:
        toks, plps = run(g, dtype, "fp8" if kv == "wrong" else kv, wrong=kv == "wrong")
        runs[(dtype, kv)] = toks
        r = judge(g, toks, plps)
        result["configs"][f"{dtype} weights, {kv} KV"] = r
        div = [x for x in r["cases"] if x["first_divergence"] is not None]
        margins = [x["ref_margin"] for x in div if x["ref_margin"] is not None]
        print(
            f"{dtype:8s} {kv:5s} KV: {len(div)}/{len(r['cases'])} diverge (steps "
            f"{sorted(x['first_divergence'] for x in div)}); margins there "
            f"{sorted(round(m, 3) for m in margins)}; outside the top-5: {sum(x['ref_margin'] is None for x in div)}; "
            f"largest prompt-logprob diff {max(x['max_prompt_logprob_diff'] for x in r['cases']):.4f}"
        )
        if args.delta is not None:
            rep = compare_greedy(refs, ref_lps, toks, args.delta, args.max_diverged_frac)
            print(f"    greedy rule at delta {args.delta}: {'passes' if rep.ok else 'FAILS'} ({rep.summary()})")
            r["rule"] = {"delta": args.delta, "ok": rep.ok, "summary": rep.summary()}
    num_steps, above = margin_shares(g["cases"])
    result["share_above"] = above
    print(
        f"golden steps: {num_steps}; share with a top1-top2 margin above delta: "
        + ", ".join(f"{d:g}: {v:.1%}" for d, v in above.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
