"""Measure how far llama.cpp on quantized weights is from the reference on the dequantized ones,
and show that the greedy rule at a chosen delta still rejects a wrong engine.

    python scripts/quantized_margins.py [--golden smollm2-135m] [--delta 0.5] [--json out.json]

For every golden case: the engine's 64 greedy tokens (EOS ignored), the first step where they
leave the reference's, and the reference's margin there (its logprob of its own token minus its
logprob of the engine's; None when the engine's token is outside the recorded top-5); the
largest difference of the prompt logprobs; over all golden steps, how many have a top-1 / top-2
margin above candidate deltas (what the greedy rule can still catch at that delta). Then the
same engine with a wrong RoPE base (half the model's) is judged by the greedy rule at --delta:
it must fail. These are the data behind conformance.compare's delta and tolerance for
quantized arithmetic (docs/conformance/llama-cpp.md).
"""

from __future__ import annotations

import argparse
import json

import golden
from conformance.adapters import Sampling
from conformance.adapters.llama_cpp_adapter import LlamaCppAdapter
from conformance.compare import compare_greedy
from conformance.harness import golden_divergence, golden_step_logprobs, margin_shares


def run(engine, g) -> tuple[list, list]:
    cases = g["cases"]
    got = engine.generate([c["prompt"] for c in cases], [Sampling.greedy(g["max_tokens"])] * len(cases))
    scored = engine.generate([c["prompt"] for c in cases], [Sampling.greedy(1, prompt_logprobs=1)] * len(cases))
    return [r.token_ids for r in got], [r.prompt_logprobs for r in scored]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--golden", default=golden.SMOLLM)
    ap.add_argument("--delta", type=float, default=None, help="candidate delta for the wrong-engine control")
    ap.add_argument(
        "--max-diverged-frac", type=float, default=0.5, help="candidate share of sequences that may diverge"
    )
    ap.add_argument("--logprob-tol", type=float, default=None, help="candidate prompt-logprob tolerance")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    g = golden.load(args.golden)
    cases = g["cases"]
    engine = LlamaCppAdapter()
    engine.load(golden.model_dir(g), dtype="float32", seed=0)
    toks, plps = run(engine, g)
    base = engine.llm.metadata.get(f"{engine.llm.metadata.get('general.architecture')}.rope.freq_base")
    desc = engine.describe()
    engine.close()
    rows = []
    for c, out, plp in zip(cases, toks, plps):
        row = golden_divergence(c, out, plp)
        rows.append(row)
        step, margin = row["first_divergence"], row["ref_margin"]
        print(
            f"{c['id']:16s} diverges at {step!s:>4s}  ref margin "
            f"{'-' if margin is None else f'{margin:.4f}':>8s}  max prompt-logprob diff {row['max_prompt_logprob_diff']:.4f}"
        )
    num_steps, above = margin_shares(cases)
    print(
        f"golden steps: {num_steps}; share with a top1-top2 margin above delta: "
        + ", ".join(f"{d:g}: {v:.1%}" for d, v in above.items())
    )
    margins = [r["ref_margin"] for r in rows if r["ref_margin"] is not None]
    print(
        f"divergences: {sum(r['first_divergence'] is not None for r in rows)}/{len(rows)}; largest margin at "
        f"one: {max(margins, default=float('nan')):.4f}; outside the top-5: "
        f"{sum(r['first_divergence'] is not None and r['ref_margin'] is None for r in rows)}; largest "
        f"prompt-logprob diff {max(r['max_prompt_logprob_diff'] for r in rows):.4f}"
    )
    result = {"engine": desc, "golden": args.golden, "cases": rows, "share_above": above}
    if args.delta is not None:
        refs, ref_lps = [c["greedy"] for c in cases], [golden_step_logprobs(c) for c in cases]
        right = compare_greedy(refs, ref_lps, toks, args.delta, args.max_diverged_frac)
        wrong_engine = LlamaCppAdapter(rope_freq_base=float(base) / 2)
        wrong_engine.load(golden.model_dir(g), dtype="float32", seed=0)
        wrong, wrong_plps = run(wrong_engine, g)
        wrong_engine.close()
        bad = compare_greedy(refs, ref_lps, wrong, args.delta, args.max_diverged_frac)
        if args.logprob_tol is not None:
            for what, lps in (("llama.cpp", plps), ("wrong engine", wrong_plps)):
                diffs = [
                    abs(lp[p][c["prompt"][p]].logprob - c["prompt_lps"][p - 1])
                    for c, lp in zip(cases, lps)
                    for p in range(1, len(c["prompt"]))
                ]
                print(
                    f"prompt logprobs, {what}: largest |diff| {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f} "
                    f"({'within' if max(diffs) <= args.logprob_tol else 'OUTSIDE'} tolerance {args.logprob_tol})"
                )
                result.setdefault("prompt_logprob_diffs", {})[what] = {
                    "max": max(diffs),
                    "mean": sum(diffs) / len(diffs),
                }
        print(
            f"delta {args.delta}: llama.cpp {'passes' if right.ok else 'FAILS'} ({right.summary()}); "
            f"wrong engine (RoPE base {float(base) / 2:g} instead of {float(base):g}) "
            f"{'passes: the rule is too loose' if bad.ok else 'is rejected'} ({bad.summary()})"
        )
        result["control"] = {
            "delta": args.delta,
            "right": right.summary(),
            "right_ok": right.ok,
            "wrong": bad.summary(),
            "wrong_ok": bad.ok,
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
