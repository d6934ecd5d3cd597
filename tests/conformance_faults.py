"""Faulty engines for the conformance checks: each one is nanovllm with ONE plausible bug.

A check that is never run against a wrong engine can become empty and still pass a right one
(a flipped sign, a value compared with itself: both survived the whole test suite once). Each
class below is the nanovllm adapter with one bug injected where a check can see it, by changing
what ``load`` / ``generate`` pass to the engine or what they return; ``CONTROLS`` names, for every
check that runs the engine, the faults it must catch and a ``-k`` selection of its cheapest
parametrization on the CPU; ``EXEMPT`` names the checks that cannot be controlled here, and why;
``GAPS`` names faults that no check catches today (findings: the checks have no observable for them).
``tests/test_conformance_controls.py`` keeps the registry complete (fast) and runs each fault
(slow): ``python -m conformance --adapter conformance_faults:<Fault> --device cpu -k <checks>``
must fail every check listed for it, and the plain nanovllm adapter must pass the same checks.

The faults act on the adapter's boundary, not the engine's source (``tests/mutants`` does that):
they are quick to write and to run, and what they model is a bug's effect as a check sees it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

from conformance.adapters.base import Logprob, Result
from conformance.adapters.nanovllm_adapter import NanovllmAdapter


class Fault(NanovllmAdapter):
    """nanovllm, remembering what ``load`` was given: faults that depend on a knob read it here.
    Each subclass is named ``fault-<Class>`` in the suite's messages and reports."""

    name = "fault"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.name = f"fault-{cls.__name__}"

    def load(self, model_dir: str, **knobs) -> None:
        self.model_dir, self.knobs = model_dir, knobs
        super().load(model_dir, **knobs)

    def model_config(self, file: str = "config.json") -> dict:
        path = Path(self.model_dir) / file
        return json.loads(path.read_text()) if path.is_file() else {}

    def other_token(self, token: int) -> int:
        """A valid token id that is not ``token`` (a wrong token the engine can still be fed)."""
        return token + 1 if token + 1 < self.model_config()["vocab_size"] else token - 1

    def swap_from(self, result: Result, step: int) -> None:
        """Replace every output token from ``step`` on with another one."""
        result.token_ids[step:] = [self.other_token(t) for t in result.token_ids[step:]]


def _shift(entries, by: float, first: int = 0):
    """Logprob entries (per position) with every value from position ``first`` on moved by ``by``."""
    if entries is None:
        return None
    return [
        e if e is None or i < first else {t: Logprob(lp.logprob + by, lp.rank) for t, lp in e.items()}
        for i, e in enumerate(entries)
    ]


# --------------------------------------------------------------------------- tokens
class GreedyRunnerUpOnce(Fault):
    """Decode picks the runner-up once, where the argmax leads by more than 1 nat (a wrong argmax
    reduction at one step): the first such step from step 4 on, in every greedy request of more
    than 4 tokens that asked for no logprobs (the re-scoring prefills of the checks are left right)."""

    def generate(self, prompts, params):
        asked = [
            p.with_(logprobs=2) if p.temperature == 0 and p.logprobs is None and p.max_tokens > 4 else p for p in params
        ]
        results = super().generate(prompts, asked)
        for r, p, a in zip(results, params, asked):
            if a is p:
                continue
            for t, entry in enumerate(r.logprobs):
                ranked = sorted(entry, key=lambda tok: entry[tok].rank)
                if t >= 4 and entry[ranked[0]].logprob - entry[ranked[1]].logprob > 1.0:
                    r.token_ids[t] = ranked[1]
                    break
            r.logprobs = None
        return results


class MaxTokensPlusOne(Fault):
    """A request runs one token past max_tokens (an off-by-one in the length check)."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(max_tokens=p.max_tokens + 1) for p in params])


class OutputsInFinishOrder(Fault):
    """Results come back in the order requests finished (shortest first), not in input order."""

    def generate(self, prompts, params):
        return sorted(super().generate(prompts, params), key=lambda r: len(r.token_ids))


class BatchSizeChangesTokens(Fault):
    """In a batch of 9 or more, greedy tokens from step 5 on change (a kernel whose result
    depends on the batch size)."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r, p in zip(results, params):
            if len(prompts) >= 9 and p.temperature == 0:
                self.swap_from(r, 5)
        return results


class BatchSizeChangesLogprobs(Fault):
    """In a batch of 2 or more, every decode logprob moves by one float64 ulp (a reduction summed
    in another order when a row has batch-mates); tokens are unchanged."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results if len(prompts) > 1 else ():
            if r.logprobs is not None:
                r.logprobs = [
                    {t: Logprob(math.nextafter(lp.logprob, 0.0), lp.rank) for t, lp in e.items()} for e in r.logprobs
                ]
        return results


# --------------------------------------------------------------------------- stopping
class StopTokenIdsIgnored(Fault):
    """stop_token_ids are dropped: the request runs on to max_tokens."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(stop_token_ids=()) for p in params])


class MinTokensIgnored(Fault):
    """min_tokens is dropped: a stop token or stop string may end the request at once."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(min_tokens=0) for p in params])


class MinTokensBanOneTooLong(Fault):
    """Stop tokens stay banned one step past min_tokens (an off-by-one in the ban)."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(min_tokens=p.min_tokens + 1) if p.min_tokens else p for p in params])


class EosIgnored(Fault):
    """The model's EOS ids never stop a request (ignore_eos always on)."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(ignore_eos=True) for p in params])


class IgnoreEosIgnored(Fault):
    """ignore_eos is dropped: EOS stops a request that asked to run on."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(ignore_eos=False) for p in params])


class OnlyFirstEosIdStops(Fault):
    """Only the first EOS id of generation_config.json stops a request (the others, as Llama 3 and
    Qwen2.5 list them, are ignored): modelled as ignore_eos plus a stop token, reported as EOS."""

    def generate(self, prompts, params):
        eos = self.model_config("generation_config.json").get("eos_token_id")
        first = eos[0] if isinstance(eos, list) else eos
        asked = [
            p if p.ignore_eos else p.with_(ignore_eos=True, stop_token_ids=(*p.stop_token_ids, first)) for p in params
        ]
        results = super().generate(prompts, asked)
        for r, p in zip(results, params):
            if r.stop_reason == first and first not in p.stop_token_ids:
                r.stop_reason = None
        return results


class StopStringNotTrimmed(Fault):
    """A stop string ends the request but stays in the text (include_stop_str_in_output always on)."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(include_stop_str_in_output=True) if p.stop else p for p in params])


# --------------------------------------------------------------------------- logprobs
class PromptLogprobsShifted(Fault):
    """Every prompt logprob is 0.2 too high (a wrong normaliser in the prompt-logprob path)."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            r.prompt_logprobs = _shift(r.prompt_logprobs, 0.2)
        return results


class DecodeLogprobsShifted(Fault):
    """Every decode logprob is 0.2 too high (a wrong normaliser in the output-logprob path)."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            r.logprobs = _shift(r.logprobs, 0.2)
        return results


class SampledLogprobsShifted(Fault):
    """The decode logprobs of sampled (temperature > 0) requests are 0.2 too high: taken from the
    distribution after temperature, not the raw model's; greedy requests are right."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r, p in zip(results, params):
            if p.temperature > 0:
                r.logprobs = _shift(r.logprobs, 0.2)
        return results


class LogprobRanksOffByOne(Fault):
    """Decode logprob ranks count from 2 (0-based ranks plus one twice); the values are right."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            if r.logprobs is not None:
                r.logprobs = [{t: Logprob(lp.logprob, lp.rank + 1) for t, lp in e.items()} for e in r.logprobs]
        return results


class LogprobsZeroAsNone(Fault):
    """logprobs=0 / prompt_logprobs=0 are read as "none asked" (a falsy test instead of ``is None``)."""

    def generate(self, prompts, params):
        asked = [p.with_(logprobs=p.logprobs or None, prompt_logprobs=p.prompt_logprobs or None) for p in params]
        return super().generate(prompts, asked)


# --------------------------------------------------------------------------- sampling
class TemperatureIgnored(Fault):
    """Random sampling always at temperature 1 (the request's temperature is not applied)."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(temperature=1.0) if p.temperature > 0 else p for p in params])


class TopKOneTooMany(Fault):
    """top_k keeps one token too many (an off-by-one in the kth-value cut)."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(top_k=p.top_k + 1) if p.top_k else p for p in params])


class FirstRowSettingsForAll(Fault):
    """Every row of a batch samples with the first row's temperature and filters (per-batch, not
    per-row, sampling parameters)."""

    def generate(self, prompts, params):
        first = params[0]
        keys = ("temperature", "top_k", "top_p", "min_p")
        return super().generate(prompts, [p.with_(**{k: getattr(first, k) for k in keys}) for p in params])


class SeedIgnored(Fault):
    """Per-request seeds are dropped: seeded requests sample like unseeded ones."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(seed=None) for p in params])


class SeedZeroUnseeded(Fault):
    """seed=0 is taken for "no seed" (a falsy test instead of ``is None``)."""

    def generate(self, prompts, params):
        return super().generate(prompts, [p.with_(seed=p.seed or None) for p in params])


# --------------------------------------------------------------------------- engine knobs
class ChunkedPrefillCorrupts(Fault):
    """With a finite max_batched_tokens, a prompt longer than the budget (prefilled in chunks)
    comes out wrong: its tokens from step 1 on and its prompt logprobs past the first chunk
    (a chunk offset lost between chunks)."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        budget = self.knobs.get("max_batched_tokens")
        for prompt, r in zip(prompts, results):
            if budget not in (None, float("inf")) and len(prompt) > budget:
                self.swap_from(r, 1)
                r.prompt_logprobs = _shift(r.prompt_logprobs, 0.2, first=int(budget))
        return results


class PrefixHitCorruptsTokens(Fault):
    """With the prefix cache on, a request served from the cache decodes wrong tokens from step 1
    on (a cached block's KV read at the wrong slot)."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            if self.knobs.get("prefix_cache") and r.num_cached_tokens:
                self.swap_from(r, 1)
        return results


class CachedCounterInBlocks(Fault):
    """num_cached_tokens counts cached blocks, not tokens."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            if r.num_cached_tokens:
                r.num_cached_tokens //= self.knobs.get("block_size") or 16
        return results


class PreemptedRequestsDiverge(Fault):
    """A preempted request resumes at a wrong position: its tokens from step 100 on differ."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            if r.num_preemptions:
                self.swap_from(r, 100)
        return results


class PreemptionCounterZero(Fault):
    """The engine-wide and per-request preemption counters stay at 0 (never incremented)."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            r.num_preemptions = 0 if r.num_preemptions is not None else None
        return results

    def stats(self) -> dict:
        return {**super().stats(), "preemptions": 0}


class PreemptedPromptLogprobsRepeated(Fault):
    """A preempted request's prompt logprobs are appended again when it is recomputed (a
    historical nanovllm bug: tokens unaffected)."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results:
            if r.num_preemptions and r.prompt_logprobs is not None:
                r.prompt_logprobs = r.prompt_logprobs + r.prompt_logprobs[1:]
        return results


class AsyncSchedulingCorrupts(Fault):
    """With async scheduling on, the token after a step in flight is read from the wrong row:
    every request's tokens from step 3 on differ."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r in results if self.knobs.get("async_scheduling") else ():
            self.swap_from(r, 3)
        return results


class AsyncKnobIgnored(Fault):
    """async_scheduling is accepted and ignored: every step runs synchronously."""

    def load(self, model_dir: str, **knobs) -> None:
        super().load(model_dir, **{k: v for k, v in knobs.items() if k != "async_scheduling"})


class RefusalBecomesTruncation(Fault):
    """A request the engine cannot take (longer than max_model_len or the whole KV cache) is not
    refused: it is silently cut to its last 8 prompt tokens and at most 8 new ones."""

    def generate(self, prompts, params):
        try:
            return super().generate(prompts, params)
        except ValueError:
            return super().generate(
                [p[-8:] for p in prompts], [p.with_(max_tokens=min(p.max_tokens, 8)) for p in params]
            )


class TpKnobIgnored(Fault):
    """The tp knob is accepted and ignored: the engine runs on one rank whatever it was asked (so a
    tensor-parallel size the heads do not split into is never refused)."""

    def load(self, model_dir: str, **knobs) -> None:
        super().load(model_dir, **{k: v for k, v in knobs.items() if k != "tp"})


class TpRanksDisagree(Fault):
    """With tp > 1 the ranks' partial results are combined wrongly (an all-reduce skipped):
    greedy tokens from step 4 on differ."""

    def generate(self, prompts, params):
        results = super().generate(prompts, params)
        for r, p in zip(results, params):
            if (self.knobs.get("tp") or 1) > 1 and p.temperature == 0:
                self.swap_from(r, 4)
        return results


# --------------------------------------------------------------------------- known gaps
class ChunkBudgetIgnored(Fault):
    """max_batched_tokens and chunked_prefill are accepted and ignored: every prompt is prefilled
    whole, whatever the budget."""

    def load(self, model_dir: str, **knobs) -> None:
        super().load(
            model_dir, **{k: v for k, v in knobs.items() if k not in ("max_batched_tokens", "chunked_prefill")}
        )


class TpIgnoredWhereItSplits(Fault):
    """tp is ignored (one rank) whenever the query heads split over the ranks; a size they do not
    split into is still refused."""

    def load(self, model_dir: str, **knobs) -> None:
        heads = json.loads((Path(model_dir) / "config.json").read_text())["num_attention_heads"]
        if heads % (knobs.get("tp") or 1) == 0:
            knobs = {k: v for k, v in knobs.items() if k != "tp"}
        super().load(model_dir, **knobs)


# --------------------------------------------------------------------------- the registry
class Control(NamedTuple):
    """One fault a check must catch: the fault class, a ``-k`` expression that selects the check's
    cheapest parametrization on the CPU (and nothing else), and text its failure message holds."""

    fault: str
    k: str
    expect: str = ""


C = Control
CONTROLS: dict[str, tuple[Control, ...]] = {
    # test_reference.py (zoo models: SmolLM2 takes 10 s a check here)
    "test_prompt_logprobs_match_reference": (
        C("PromptLogprobsShifted", "test_prompt_logprobs_match_reference and llama-mha-hd64", "not close"),
    ),
    "test_greedy_matches_reference": (
        C("GreedyRunnerUpOnce", "test_greedy_matches_reference and llama-mha-hd64", "margin"),
    ),
    "test_fp32_greedy_exact_on_zoo": (
        C("GreedyRunnerUpOnce", "test_fp32_greedy_exact_on_zoo and llama-mha-hd64", "failure(s)"),
    ),
    "test_prefill_decode_consistency": (
        C("GreedyRunnerUpOnce", "test_prefill_decode_consistency and llama-1kv-hd128", "decode/prefill disagreements"),
    ),
    # test_contracts.py
    "test_max_tokens_finish_length": (C("MaxTokensPlusOne", "test_max_tokens_finish_length"),),
    "test_stop_token_ids": (C("StopTokenIdsIgnored", "test_stop_token_ids", "stop at (and include) the stop token"),),
    "test_min_tokens_defers_stop": (C("MinTokensIgnored", "test_min_tokens_defers_stop", "min_tokens"),),
    "test_eos_stops_unless_ignored": (
        C("EosIgnored", "test_eos_stops_unless_ignored", "stop at (and include) EOS"),
        C("IgnoreEosIgnored", "test_eos_stops_unless_ignored"),
    ),
    "test_stop_strings_trimmed_or_included": (
        C("StopStringNotTrimmed", "test_stop_strings_trimmed_or_included", "expected"),
    ),
    "test_logprobs_greedy_match_reference": (
        C("DecodeLogprobsShifted", "test_logprobs_greedy_match_reference", "logprobs differ from the reference"),
        C("LogprobRanksOffByOne", "test_logprobs_greedy_match_reference", "ranks"),
    ),
    "test_logprobs_sampled_are_raw_distribution": (
        C("SampledLogprobsShifted", "test_logprobs_sampled_are_raw_distribution", "differ from the prefill"),
        C("LogprobRanksOffByOne", "test_logprobs_sampled_are_raw_distribution", "ranks"),
    ),
    # test_boundaries.py
    "test_stop_token_at_exactly_min_tokens": (
        C("MinTokensBanOneTooLong", "test_stop_token_at_exactly_min_tokens and len-3bs", "must stop right there"),
    ),
    "test_stop_token_banned_until_min_tokens": (
        C("MinTokensIgnored", "test_stop_token_banned_until_min_tokens and len-3bs", "is banned"),
    ),
    "test_stop_string_spanning_a_token_boundary": (
        C("StopStringNotTrimmed", "test_stop_string_spanning_a_token_boundary", "expected"),
    ),
    "test_stop_string_counts_only_past_min_tokens": (
        C("MinTokensIgnored", "test_stop_string_counts_only_past_min_tokens", "not a stop"),
    ),
    "test_prompt_logprobs_of_a_long_prompt": (
        C("ChunkedPrefillCorrupts", "test_prompt_logprobs_of_a_long_prompt", "positions differ"),
    ),
    "test_zero_logprobs_give_the_token_alone": (
        C("LogprobsZeroAsNone", "test_zero_logprobs_give_the_token_alone", "logprobs=0"),
    ),
    # test_model_config.py
    "test_every_eos_id_stops": (
        C("OnlyFirstEosIdStops", "test_every_eos_id_stops", "must stop at (and include) EOS id"),
        C("IgnoreEosIgnored", "test_every_eos_id_stops"),
    ),
    "test_prompt_longer_than_the_model_context": (
        C("RefusalBecomesTruncation", "test_prompt_longer_than_the_model_context", "finished normally"),
    ),
    # test_admission.py
    "test_prompt_longer_than_max_model_len": (
        C("RefusalBecomesTruncation", "test_prompt_longer_than_max_model_len", "finished normally"),
    ),
    "test_request_larger_than_the_whole_kv_cache": (
        C("RefusalBecomesTruncation", "test_request_larger_than_the_whole_kv_cache", "finished normally"),
    ),
    # test_sampling.py (1,000 to 1,500 one-token samples a check)
    "test_sampling_distribution": (
        C("TemperatureIgnored", "test_sampling_distribution and temperature", "p="),
        C("TopKOneTooMany", "test_sampling_distribution and top_k", "outside"),
    ),
    "test_seeded_requests_reproducible_and_batch_independent": (
        C("SeedIgnored", "test_seeded_requests_reproducible_and_batch_independent", "seed"),
    ),
    "test_filters_at_other_temperatures": (
        C("TemperatureIgnored", "test_filters_at_other_temperatures and min_p", "allowed"),
    ),
    "test_mixed_rows_in_one_batch": (C("FirstRowSettingsForAll", "test_mixed_rows_in_one_batch", "mixed batch"),),
    "test_seed_zero_is_a_seed": (C("SeedZeroUnseeded", "test_seed_zero_is_a_seed", "seed=0"),),
    # test_self_consistency.py
    "test_batch_invariance": (
        C("BatchSizeChangesTokens", "test_batch_invariance and not logprobs", "differs from its solo run"),
    ),
    "test_batch_invariance_of_logprobs": (
        C("BatchSizeChangesLogprobs", "test_batch_invariance_of_logprobs", "logprobs differ from its solo run"),
    ),
    "test_chunked_prefill_equivalence": (
        C("ChunkedPrefillCorrupts", "test_chunked_prefill_equivalence and 16", "budget 16"),
        C("ChunkBudgetIgnored", "test_chunked_prefill_equivalence and 16", "the token budget was not applied"),
    ),
    "test_prefix_cache_on_off": (C("PrefixHitCorruptsTokens", "test_prefix_cache_on_off", "prefix cache on"),),
    "test_prefix_cache_counter": (C("CachedCounterInBlocks", "test_prefix_cache_counter", "cached-token counters"),),
    "test_preemption_equivalence": (
        C("PreemptedRequestsDiverge", "test_preemption_equivalence", "starved (preempting) vs ample"),
        C("PreemptionCounterZero", "test_preemption_equivalence", "never preempted"),
    ),
    "test_outputs_in_input_order": (C("OutputsInFinishOrder", "test_outputs_in_input_order", "input order"),),
    "test_async_scheduling_equivalence": (
        C("AsyncSchedulingCorrupts", "test_async_scheduling_equivalence", "async vs sync scheduling"),
        C("AsyncKnobIgnored", "test_async_scheduling_equivalence", "never overlapped"),
    ),
    # test_preemption_fields.py
    "test_every_request_field_survives_preemption": (
        C("PreemptedPromptLogprobsRepeated", "test_every_request_field_survives_preemption", "prompt_logprobs"),
        C("PreemptionCounterZero", "test_every_request_field_survives_preemption", "never preempted"),
    ),
    # test_prefix_cache_same_step.py
    "test_same_step_shared_prefix_stays_hittable": (
        C("CachedCounterInBlocks", "test_same_step_shared_prefix_stays_hittable", "cached tokens after a same-step"),
    ),
    # test_tensor_parallel.py (gloo on the CPU: a few seconds a check)
    "test_tp2_equals_tp1_gloo_cpu": (
        C("TpRanksDisagree", "test_tp2_equals_tp1_gloo_cpu", "TP=2 vs reference"),
        C("TpIgnoredWhereItSplits", "test_tp2_equals_tp1_gloo_cpu", "the engine reports 1 rank(s)"),
    ),
    "test_tp4_replicated_kv_heads_gloo_cpu": (
        C("TpRanksDisagree", "test_tp4_replicated_kv_heads_gloo_cpu", "TP=4 vs reference"),
        C("TpIgnoredWhereItSplits", "test_tp4_replicated_kv_heads_gloo_cpu", "the engine reports 1 rank(s)"),
    ),
    "test_tp_size_that_does_not_split_the_heads_is_refused": (
        C("TpKnobIgnored", "test_tp_size_that_does_not_split_the_heads_is_refused", "was accepted"),
    ),
}

EXEMPT: dict[str, str] = {
    "test_cuda_graph_equals_eager": "needs a CUDA GPU (marker gpu): on a CPU-only machine it is skipped, so no "
    "fault can make it fail here; a GPU host could control it with a fault that perturbs tokens when cuda_graph=True",
    "test_tp2_equals_tp1_nccl": "needs two CUDA GPUs (marker multi_gpu, NCCL); its body is _check(), the one "
    "test_tp2_equals_tp1_gloo_cpu runs on the CPU, which TpRanksDisagree controls here",
}


# Faults that NO check catches (findings, not controls): each runs with its selection and passes.
# An equivalence check compares a mechanism's outputs with the outputs without it; when the engine
# ignores the knob, both are the same run and the check passes having checked nothing, unless it
# has an observable of the mechanism (the prefix-cache counter, the preemption counter,
# pipelined_steps, and since 2026-12-07 the steps a prompt's prefill took and the ranks the engine
# reports, which closed the two gaps this registry first listed: ChunkBudgetIgnored and
# TpIgnoredWhereItSplits, now controls above). The slow test asserts a gap still passes: when a
# check learns to catch one, move it to CONTROLS.
GAPS: dict[str, Control] = {}


def faults() -> dict[str, type[Fault]]:
    """Every fault class of this module, by name."""
    return {
        n: c
        for n, c in globals().items()
        if isinstance(c, type) and issubclass(c, Fault) and c is not Fault and n not in GAPS
    }


def checks_of(fault: str) -> dict[str, str]:
    """The checks ``fault`` must fail, each with the text its failure message must hold."""
    return {check: c.expect for check, controls in CONTROLS.items() for c in controls if c.fault == fault}


def selection(fault: str | None = None) -> str:
    """The ``-k`` expression of one fault's controls, or of all of them (``fault`` None)."""
    ks = sorted({c.k for controls in CONTROLS.values() for c in controls if fault in (None, c.fault)})
    return " or ".join(f"({k})" for k in ks)


def missing(checks: set[str]) -> list[str]:
    """The engine-using checks that have neither a control nor an exemption."""
    return sorted(checks - set(CONTROLS) - set(EXEMPT))
