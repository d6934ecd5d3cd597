"""Prefix cache when several requests compute the same prefix together (in the same step).

The prefix-cache checks of test_self_consistency admit requests one at a time. Sent together into a cold cache, requests that share a
prefix compute its blocks in the same step: one engine-internal copy is kept, the others are
duplicates, and each request's continuation must still chain to what was kept. The rule is the
same as one at a time, and does not depend on how the engine ordered the work: a later request
is served bs * floor(longest common prefix with anything computed before / bs) tokens, capped
so its last token is computed (``expected_cached``). Probes extend each request's computed
tokens (prompt and output but the last token), so they reach past the shared blocks into each
request's own ones, including blocks of generated tokens.
"""

from __future__ import annotations

import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY, PREFIX_CACHE_STATS
from conformance.harness import generate, require
from conformance.test_self_consistency import expected_cached

MODEL = "llama-mha-hd64"


def test_same_step_shared_prefix_stays_hittable(engines, figure):
    g = golden.load(MODEL)
    problem = golden.check_model(g)
    if problem:
        pytest.fail(problem)
    cases = {c["id"]: c for c in g["cases"]}
    bs = engines.bs
    on = engines.fresh(golden.model_dir(g), prefix_cache=True)
    require(on, GREEDY, PREFIX_CACHE_STATS)
    a, b, other = cases["prefix-2bs-a"]["prompt"], cases["prefix-2bs-b"]["prompt"], cases["len-bs"]["prompt"]
    assert a[: 2 * bs] == b[: 2 * bs] and a[2 * bs] != b[2 * bs], "the golden prefix cases must share 2 blocks"
    params = Sampling.greedy(3 * bs)
    # a, b and a again in one call: with room for all, they are prefilled together
    wave = generate(on, [a, b, a], params)
    assert wave[0].num_cached_tokens == 0, "the cold cache served tokens"
    history = [p + r.token_ids[:-1] for p, r in zip([a, b, a], wave)]
    got, want = [], []
    for i, base in enumerate(history[:2]):
        for cut in (len(base), 3 * bs + 2):  # all computed tokens; one block past the shared ones
            probe = base[:cut] + other[: 3 + i]
            out = generate(on, [probe], Sampling.greedy(2))[0]
            want.append(expected_cached(history, probe, bs))
            got.append(out.num_cached_tokens)
            history.append(probe + out.token_ids[:-1])
    figure("cached tokens", sum(got))
    assert min(want) > 2 * bs, "the probes must reach past the shared blocks (weak check otherwise)"
    assert got == want, f"cached tokens after a same-step prefix: {got}, expected {want} (block size {bs})"
