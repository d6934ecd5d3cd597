"""The mutant machinery works: a mutant switched on in this process breaks the engine, switched off
the engine is right again; (slow) the whole table: every mutant is caught by at least one check."""

from __future__ import annotations

import pytest

import golden
from tests.conftest import cached_llm


def test_mutant_machinery_smoke():
    from nanovllm import SamplingParams
    from tests.mutants.runner import activate

    g = golden.load("qwen3-gqa4-hd128")
    case = next(c for c in g["cases"] if c["id"] == "len-bs+1")
    llm = cached_llm(golden.model_dir(g), enable_prefix_caching=False)  # no corrupted K/V is reused
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": case["prompt"]}
    with activate("slot_mapping_off_by_one"):
        bad = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    good = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert good == case["greedy"][:16]
    assert bad != good, "the slot-mapping mutant did not change the output"


@pytest.mark.slow
def test_every_mutant_is_caught():
    """The full mutant table (python -m tests.mutants.runner): no mutant survives."""
    from tests.mutants.runner import main

    assert main([]) == 0
