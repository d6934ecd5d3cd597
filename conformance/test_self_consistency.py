"""Self-consistency: the engine's mechanisms must not change its tokens (float32: bitwise).

- batch invariance: a needle prompt alone vs inside batches of 1..10, 15, 16, 17, 31, 32, 33; and,
  for engines that claim it (``batch_invariant``), its logprobs bitwise, on a model whose products
  sum K = 1,536 (past the reductions where a GEMM may sum a lone row otherwise);
- chunked prefill at token budgets {7, 16, 17, 64, inf} vs the golden greedy tokens and each other;
- prefix cache on/off: boundary prefix, partial block, fully cached prompt, cold then hot;
  the cached-token counter equals the expected multiple of the block size;
- preemption: >= 256 generated tokens under a starved KV budget equal the ample run, with
  the preemption counter > 0;
- outputs come back in input order;
- async scheduling (the next step queued before this one's tokens are read back) gives the
  tokens of synchronous scheduling: greedy and seeded rows, length finishes, stop tokens met
  while the next step is in flight, preemption.
"""

from __future__ import annotations

import numpy as np
import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY, LOGPROBS, PREEMPTION_STATS, PREFIX_CACHE_STATS, Capability
from conformance.compare import assert_tokens_equal, compare_greedy
from conformance.harness import delta, generate, golden_step_logprobs, require, skip_lacking, tokens
from conformance.zoo import ZOO

MODEL = "qwen3-gqa4-hd128"
BATCH_SIZES = [*range(1, 11), 15, 16, 17, 31, 32, 33]
BUDGETS = [7, 16, 17, 64, float("inf")]


def _golden():
    g = golden.load(MODEL)
    golden.require(g)
    return g, {c["id"]: c for c in g["cases"]}


def _fillers(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, vocab, size=int(rng.integers(1, 60))).tolist() for _ in range(n)]


def _assert_golden_prefix(g, cases: list[dict], got: list[list[int]], what: str) -> None:
    """The first len(got[i]) greedy tokens must match the golden ones (tie-aware)."""
    refs = [c["greedy"][: len(t)] for c, t in zip(cases, got)]
    report = compare_greedy(refs, [golden_step_logprobs(c) for c in cases], got, delta(g["dtype"]))
    assert report.ok, f"{what} vs reference: {report.summary()}"


def test_batch_invariance(engines, figure):
    """The needle's greedy tokens do not depend on how many batch-mates it has."""
    g, cases = _golden()
    engine = engines.get(golden.model_dir(g))
    require(engine, GREEDY)
    needle = cases["len-bs+1"]["prompt"]
    params = Sampling.greedy(12)
    alone = tokens(generate(engine, [needle], params))[0]
    _assert_golden_prefix(g, [cases["len-bs+1"]], [alone], "needle alone")
    vocab = ZOO[MODEL].vocab_size
    differ = []
    for n in BATCH_SIZES:
        batch = _fillers(vocab, n - 1, seed=n)
        pos = (3 * n) // 4  # the needle's place moves with the batch size
        batch.insert(pos, needle)
        got = tokens(generate(engine, batch, params))[pos]
        if got != alone:
            differ.append(n)
    figure("batch sizes differing", len(differ))
    assert not differ, f"needle differs from its solo run in batches of {differ}"


WIDE_MODEL = "llama-wide-mlp"


def test_batch_invariance_of_logprobs(engines, figure):
    """An engine that claims batch invariance: the needle's greedy tokens and its chosen tokens'
    logprobs, alone and among 1, 2, 6 and 15 others, are the same bitwise, on a model whose down
    projection sums K = 1,536. Tokens alone miss what this sees: a lone row summed in another order
    moved 57 of 64 of SmolLM2's logprobs and none of its tokens."""
    from conformance.zoo import zoo_model

    require(engines, GREEDY, LOGPROBS, Capability.BATCH_INVARIANT)  # before building or loading anything
    engine = engines.get(zoo_model(WIDE_MODEL))
    vocab = ZOO[WIDE_MODEL].vocab_size
    needle = _fillers(vocab, 1, seed=101)[0] + [7, 8, 9]
    params = Sampling.greedy(16, logprobs=1)

    def chosen(result) -> list[tuple[int, float]]:
        for step, (t, d) in enumerate(zip(result.token_ids, result.logprobs)):
            assert t in d, f"step {step}: the sampled token {t} is missing from its logprobs entry (ids {sorted(d)})"
        return [(t, d[t].logprob) for t, d in zip(result.token_ids, result.logprobs)]

    alone = chosen(generate(engine, [needle], params)[0])
    differ = []
    for n in (2, 3, 7, 16):
        batch = _fillers(vocab, n - 1, seed=200 + n)
        pos = n // 2
        batch.insert(pos, needle)
        if chosen(generate(engine, batch, params)[pos]) != alone:
            differ.append(n)
    figure("batch sizes whose logprobs differ", len(differ))
    assert not differ, f"the needle's logprobs differ from its solo run in batches of {differ}"


@pytest.mark.parametrize("budget", BUDGETS, ids=[str(b) for b in BUDGETS])
def test_chunked_prefill_equivalence(engines, budget, figure):
    """Every prompt length around block and budget edges gives the unchunked tokens."""
    g, cases = _golden()
    picked = [cases[c] for c in ("len1", "len-bs-1", "len-bs", "len-bs+1", "len-3bs", "len-5bs+3", "long")]
    knobs = {"max_batched_tokens": budget} if budget != float("inf") else {"chunked_prefill": False}
    engine = engines.get(golden.model_dir(g), **knobs)
    require(engine, GREEDY)
    got = tokens(generate(engine, [c["prompt"] for c in picked], Sampling.greedy(16)))
    _assert_golden_prefix(g, picked, got, f"budget {budget}")
    figure("sequences", len(got))
    if budget != float("inf"):
        _assert_prefilled_in_chunks(engine, cases["long"]["prompt"][::-1], budget, figure)


def _assert_prefilled_in_chunks(engine, prompt: list[int], budget: int, figure) -> None:
    """Equal tokens at every budget hold trivially where the budget is ignored: an engine that
    counts its steps (stats' ``steps``) must take at least ceil(len / budget) of them to prefill a
    prompt it has not seen (reversed: no prefix-cache hit) and sample its one token."""
    before = engine.stats().get("steps")
    generate(engine, [prompt], Sampling.greedy(1))
    after = engine.stats().get("steps")
    if before is None or after is None:
        figure("prefill steps", "not reported")
        return
    need = -(-len(prompt) // int(budget))
    figure("prefill steps", after - before)
    assert after - before >= need, (
        f"a {len(prompt)}-token prompt at budget {budget} took {after - before} step(s), not >= {need}: "
        "the token budget was not applied"
    )


def expected_cached(history: list[list[int]], prompt: list[int], bs: int) -> int:
    """What a prefix cache must serve: the longest block-aligned prefix that some earlier sequence
    computed (prompt + all generated tokens but the last), capped so the last prompt token is computed."""
    best = 0
    for seq in history:
        common = next((i for i, (x, y) in enumerate(zip(seq, prompt)) if x != y), min(len(seq), len(prompt)))
        best = max(best, common)
    return min(best // bs, (len(prompt) - 1) // bs) * bs


def test_prefix_cache_on_off(engines, figure):
    """Cold then hot runs with a prefix cache give the tokens of a run without one."""
    g, cases = _golden()
    bs = engines.bs
    model = golden.model_dir(g)
    off = engines.fresh(model, prefix_cache=False)
    on = engines.fresh(model, prefix_cache=True)
    params = Sampling.greedy(16)
    a, b, partial = cases["prefix-2bs-a"], cases["prefix-2bs-b"], cases["prefix-partial"]
    exact = a["prompt"][: 2 * bs]  # a fully cached prompt, a multiple of bs long
    prompts = [b["prompt"], partial["prompt"], a["prompt"], exact, exact[: bs + 3]]
    want = tokens(generate(off, [a["prompt"]] + prompts + [exact], params))
    cold = tokens(generate(on, [a["prompt"]], params))  # computes and caches 2 full blocks
    hot = tokens(generate(on, prompts, params))  # every one hits the cache
    again = tokens(generate(on, [exact], params))  # the exact prompt, now fully cached
    assert_tokens_equal(want, cold + hot + again, "prefix cache on (cold, hot, fully cached) vs off")
    _assert_golden_prefix(g, [a, b, partial, a], (cold + hot)[:4], "prefix cache on")
    figure("requests", len(want))


def test_prefix_cache_counter(engines, figure):
    """Cached tokens = bs * floor(common prefix / bs), capped so one token is computed."""
    g, cases = _golden()
    bs = engines.bs
    on = engines.fresh(golden.model_dir(g), prefix_cache=True)
    require(on, PREFIX_CACHE_STATS)
    params = Sampling.greedy(4)
    a, b, partial = cases["prefix-2bs-a"], cases["prefix-2bs-b"], cases["prefix-partial"]
    exact = a["prompt"][: 2 * bs]
    first = generate(on, [a["prompt"]], params)[0]
    assert first.num_cached_tokens == 0, f"cold run reports {first.num_cached_tokens} cached tokens"
    # with bs 16: b shares 2 blocks; partial shares 2 blocks + 5 tokens (a partial block is never
    # cached); a again: 39 tokens, 2 full blocks; exact: 32 tokens, fully cached, but its last token
    # is computed (so one block is served); exact[:bs+3]: one block
    history = [a["prompt"] + first.token_ids[:-1]]
    got, want = [], []
    for p in [b["prompt"], partial["prompt"], a["prompt"], exact, exact[: bs + 3]]:
        out = generate(on, [p], params)[0]
        want.append(expected_cached(history, p, bs))
        got.append(out.num_cached_tokens)
        history.append(p + out.token_ids[:-1])
    figure("cached tokens", sum(got))
    assert any(want), "the check expected no cache hit at all: it would prove nothing"
    assert got == want, f"cached-token counters {got}, expected {want} (block size {bs})"


def test_preemption_equivalence(engines, figure):
    """Starve the KV cache so requests are preempted and recomputed; tokens are unchanged."""
    g, cases = _golden()
    model = golden.model_dir(g)
    picked = [cases[c] for c in ("len-bs+1", "len-3bs", "len-5bs+3", "prefix-2bs-b")]
    params = Sampling.greedy(260)
    ample = engines.get(model)
    # 416 slots: the longest request needs 83 + 260 - 1 = 342 alone; the 4 together need ~1200.
    # max_model_len 352 leaves room for an engine that keeps one block aside (vLLM's null block)
    starved = engines.fresh(model, kv_blocks=416 // engines.bs, **engines.optional(max_model_len=352))
    want = tokens(generate(ample, [c["prompt"] for c in picked], params))
    got = tokens(generate(starved, [c["prompt"] for c in picked], params))
    _assert_golden_prefix(g, picked, [t[:64] for t in got], "starved run")
    assert_tokens_equal(want, got, "starved (preempting) vs ample KV cache")
    assert min(map(len, got)) >= 256
    require(starved, PREEMPTION_STATS)
    n = starved.stats().get("preemptions", 0)
    figure("preemptions", n)
    assert n > 0, "the starved run never preempted: the check did not exercise preemption"


def test_outputs_in_input_order(engines, figure):
    """Results line up with their prompts whatever order requests finish in."""
    g, cases = _golden()
    engine = engines.get(golden.model_dir(g))
    picked = [cases[c] for c in ("long", "len1", "len-3bs", "len-bs", "prefix-2bs-a", "len-bs+1")]
    lengths = [9, 1, 5, 13, 2, 7]
    outs = generate(engine, [c["prompt"] for c in picked], [Sampling.greedy(n) for n in lengths])
    assert [len(o.token_ids) for o in outs] == lengths, "results are not in input order (lengths)"
    _assert_golden_prefix(g, picked, tokens(outs), "tokens in input order")
    figure("requests", len(outs))


def test_async_scheduling_equivalence(engines, figure):
    """Async scheduling on vs off, same tokens and finish reasons (float32: bitwise)."""
    g, cases = _golden()
    model = golden.model_dir(g)
    if Capability.ASYNC_SCHEDULING not in engines.capabilities:
        skip_lacking(engines.name, Capability.ASYNC_SCHEDULING, "no such engine knob")
    picked = [
        cases[c] for c in ("len1", "len-bs", "len-bs+1", "len-3bs", "prefix-2bs-a", "prefix-2bs-b", "len-5bs+3", "long")
    ]
    params = []
    for i, c in enumerate(picked):
        # stop ids taken from the golden greedy tokens, so greedy rows stop mid-run for sure
        stop = [c["greedy"][5 + i]] if i % 2 == 0 else []
        base = (
            Sampling.greedy(40 + 9 * i)
            if i % 3
            else Sampling(temperature=0.9, seed=100 + i, max_tokens=40 + 9 * i, ignore_eos=True)
        )
        params.append(base.with_(stop_token_ids=tuple(stop)) if stop else base)
    prompts = [c["prompt"] for c in picked]
    pipelined = 0
    # ample: all eight run together; 200 slots: requests are preempted, recomputed and resumed
    for kv_slots in (None, 200):
        knobs = dict(**engines.optional(max_model_len=192))
        if kv_slots:
            knobs["kv_blocks"] = kv_slots // engines.bs
        want = generate(engines.fresh(model, async_scheduling=False, **knobs), prompts, params)
        asyn = engines.fresh(model, async_scheduling=True, **knobs)
        got = generate(asyn, prompts, params)
        what = f"async vs sync scheduling, {'ample' if kv_slots is None else kv_slots} KV slots"
        assert_tokens_equal(tokens(want), tokens(got), what)
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want], what
        assert any(r.finish_reason == "stop" for r in want), "no request stopped on a token: weak check"
        stats = asyn.stats()
        pipelined += stats.get("pipelined_steps", 0)
        if kv_slots:
            figure("preemptions", stats.get("preemptions"))
    if "pipelined_steps" in asyn.stats():
        figure("pipelined steps", pipelined)
        assert pipelined > 0, "async scheduling never overlapped two steps"
