"""Model configuration variety: what an engine must read from a model's config beyond its shapes.

The golden models vary ``rms_norm_eps``, ``rope_scaling`` (linear, llama3), biases and
``max_position_embeddings``; ``test_reference.py`` checks their tokens and logprobs. Two
contracts need more than one forward pass, and live here:

- every EOS id of ``generation_config.json`` stops a request, not only the first (Llama 3 and
  Qwen2.5 list several; config.json and the tokenizer name only one);
- the model's context (``max_position_embeddings``, the default max_model_len) is a limit: a prompt
  longer than it is refused with an error naming both lengths, and the engine stays usable.
"""

from __future__ import annotations

import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import EOS, GREEDY
from conformance.harness import generate, require
from conformance.test_admission import _expect_refusal, _still_works
from conformance.zoo import ZOO

MULTI_EOS = [n for n in sorted(golden.ZOO_FILES) if len(golden.load(n).get("eos_token_ids", [])) > 1]
SHORT_CONTEXT = [n for n in sorted(golden.ZOO_FILES) if ZOO[n].max_position_embeddings < 1024]


def _golden(engines, name: str, **knobs):
    g = golden.load(name)
    golden.require(g)
    return g, engines.get(golden.model_dir(g), **knobs)


def test_models_vary_the_configuration():
    """The axes are there at all: several EOS ids, a short context (and, checked by test_reference,
    non-default eps and RoPE scaling)."""
    assert MULTI_EOS, "no golden model has several EOS ids"
    assert SHORT_CONTEXT, "no golden model has a short max_position_embeddings"
    assert any(ZOO[n].rms_norm_eps != 1e-6 for n in golden.ZOO_FILES)
    assert {ZOO[n].rope_scaling["rope_type"] for n in golden.ZOO_FILES if ZOO[n].rope_scaling} >= {"linear", "llama3"}


@pytest.mark.parametrize("name", MULTI_EOS)
def test_every_eos_id_stops(engines, name, figure):
    """For each EOS id there is a golden case whose greedy output reaches it before any other EOS
    id: the engine must stop there (EOS included, finish_reason "stop", no stop_reason), and with
    ignore_eos run on."""
    g, engine = _golden(engines, name)
    require(engine, GREEDY, EOS)
    eos_ids = g["eos_token_ids"]
    cases = [c for c in g["cases"] if c["id"] == "eos" or c["id"].startswith("eos-")]
    reached = {next(t for t in c["greedy"] if t in eos_ids): c for c in cases}
    assert set(eos_ids[1:]) <= set(reached), (
        f"the golden file has cases for EOS ids {sorted(reached)} of {eos_ids}: regenerate it (python -m golden.make)"
    )
    figure("EOS ids checked", len(reached))
    for eos, c in reached.items():
        at = c["greedy"].index(eos)
        out = generate(engine, [c["prompt"]], Sampling.greedy(at + 10, ignore_eos=False))[0]
        assert out.token_ids == c["greedy"][: at + 1], (
            f"case {c['id']}: generation must stop at (and include) EOS id {eos} at step {at}, got {out.token_ids}"
        )
        assert out.finish_reason == "stop" and out.stop_reason is None, (c["id"], out.finish_reason, out.stop_reason)
        ignored = generate(engine, [c["prompt"]], Sampling.greedy(at + 10))[0]
        assert ignored.token_ids == c["greedy"][: at + 10] and ignored.finish_reason == "length", c["id"]


@pytest.mark.parametrize("name", SHORT_CONTEXT)
def test_prompt_longer_than_the_model_context(engines, name, figure):
    """With max_model_len left to the engine, a prompt longer than max_position_embeddings is
    refused, naming both lengths; the golden cases that reach exactly the limit are checked by
    test_reference."""
    g, engine = _golden(engines, name)
    require(engine, GREEDY)
    limit = ZOO[name].max_position_embeddings
    longest = max(len(c["prompt"]) + len(c["greedy"]) for c in g["cases"])
    assert longest == limit, f"the golden cases should reach exactly the context ({longest} vs {limit})"
    prompt = [t for c in g["cases"] for t in c["prompt"]][: limit + 8]
    assert len(prompt) == limit + 8
    what = _expect_refusal(engines, engine, prompt, Sampling.greedy(4), (limit + 8, limit))
    figure("refusal", what[:60])
    _still_works(engine, g)
