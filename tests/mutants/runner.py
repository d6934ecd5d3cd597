"""Injected bugs in nanovllm, and the runner that proves the suite catches each one.

A mutant is a context manager that monkeypatches nanovllm *in the test process*
(class or module attributes; shipped code on disk is never touched); on exit the
original is restored. This registry holds the engine-level mutants of
``tests/mutants/engine.py`` (model input, attention, sampler, output processing,
API, tensor parallelism, CUDA graphs) and includes the block-manager / scheduler mutants
of ``tests/mutants/core.py`` and the model-reading ones of ``tests/mutants/model.py``
(configuration fields, GGUF conversion, tensor-parallel head sharding).

    python -m tests.mutants.runner [--only NAME ...] [--jobs N] [--list]

runs, for each mutant, a targeted subset of the checks with ``--mutant NAME``
(the pytest plugin ``tests/mutants/plugin.py`` switches it on for the whole pytest run, TP workers
included) and prints a table: mutant, checks that caught it. Exit status 1 when
a mutant survives. GPU-only mutants are reported "not run" without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

from tests.mutants import engine as engine_mutants
from tests.mutants.engine import (
    _patched,
    admission_check_skipped,
    allowed_token_ids_last_dropped,
    async_input_from_wrong_row,
    bad_words_prefix_ignored,
    cuda_graph_padding_writes_kv,
    decode_drops_last_key,
    eos_ignored,
    fp8_load_ignores_scale,
    frequency_penalty_counts_prompt,
    fused_decode_attention_unscaled,
    fused_qk_norm_k_takes_q_weight,
    fused_sampler_skips_processing,
    fused_sampler_temperature_ignored,
    logit_bias_subtracted,
    logprobs_after_temperature,
    merge_pairs_by_position,
    min_p_absolute,
    min_tokens_ignored,
    mirror_ignores_stop_text,
    n_children_share_seed,
    outputs_in_finish_order,
    philox_seed_ignored,
    prefill_mask_top_left,
    presence_penalty_per_occurrence,
    prompt_logprobs_shifted,
    repetition_penalty_ignores_prompt,
    seed_ignored,
    slot_mapping_off_by_one,
    stop_string_kept,
    temperature_ignored,
    top_k_one_too_many,
    top_p_one_too_few,
    tp_allreduce_skipped,
    tp_ranks_sample_apart,
    tp_result_ignores_ticket,
    triton_decode_drops_last_key,
    triton_fp8_v_scale_ignored,
)

ENV = "NANOVLLM_MUTANT"
ROOT = Path(__file__).resolve().parent.parent.parent


# ------------------------------------------------------------------ registry
@dataclass
class Mutant:
    name: str
    make: Callable[[], ContextManager]
    checks: list[str]  # pytest selections (node ids under conformance/) that should catch it
    gpu_only: bool = False  # patches a CUDA-only path (needs a GPU)
    not_on_cuda: str = ""  # why the mutant does not apply on CUDA ("": it does)
    doc: str = field(default="")


CORE_DIR = "conformance/"
REF = CORE_DIR + "test_reference.py"
SELF = CORE_DIR + "test_self_consistency.py"
SAMP = CORE_DIR + "test_sampling.py"
CONTRACTS = CORE_DIR + "test_contracts.py"
LP = "tests/test_logits_processing.py"
OPTS = "tests/test_sampling_options.py"
GREEDY_OPTS = OPTS + "::test_greedy_with_option_matches_transformers_processors"  # ids gain [cuda] on GPU hosts
PAR = "tests/test_parallel_sampling.py"
FP8 = "tests/test_kv_cache_fp8.py"
ROWS = "tests/test_cpu_rows_linear.py"
ROWS_QUANT = "tests/test_cpu_rows_quant.py"

CPU_PATH = "patches a path the CUDA engine does not take"

ENGINE_MUTANTS: list[Mutant] = [
    Mutant(
        "slot_mapping_off_by_one",
        slot_mapping_off_by_one,
        [
            f"{REF}::test_greedy_matches_reference[qwen3-gqa4-hd128]",
            f"{REF}::test_prompt_logprobs_match_reference[llama-1kv-hd128]",
        ],
    ),
    Mutant(
        "decode_drops_last_key",
        decode_drops_last_key,  # the CPU attention (torch_ref)
        [
            f"{REF}::test_greedy_matches_reference[qwen2-gqa2-hd64]",
            f"{REF}::test_prefill_decode_consistency[qwen3-gqa4-hd128]",
        ],
        not_on_cuda=CPU_PATH,
    ),
    Mutant(
        "fused_decode_attention_unscaled",
        fused_decode_attention_unscaled,  # the CPU's decode layers in one C call (models/cpu_decode.py)
        [f"{REF}::test_greedy_matches_reference[qwen2-gqa2-hd64]"],
        not_on_cuda=CPU_PATH,
    ),
    Mutant(
        "prefill_mask_top_left",
        prefill_mask_top_left,  # invisible without chunks or cache hits
        [
            f"{REF}::test_greedy_matches_reference[llama-mha-hd64]",
            f"{SELF}::test_chunked_prefill_equivalence[17]",
            f"{SELF}::test_prefix_cache_on_off",
        ],
        not_on_cuda=CPU_PATH,
    ),
    Mutant("top_p_one_too_few", top_p_one_too_few, [f"{SAMP}::test_sampling_distribution[top_p]"]),
    Mutant("top_k_one_too_many", top_k_one_too_many, [f"{SAMP}::test_sampling_distribution[top_k]"]),
    Mutant("min_p_absolute", min_p_absolute, [f"{SAMP}::test_sampling_distribution[min_p]"]),
    # the PyTorch sampler's temperature, its synchronous entry point, its per-request generators:
    # on CUDA plain rows take the fused kernel, async scheduling launches, seeds are Philox keys
    Mutant(
        "temperature_ignored",
        temperature_ignored,
        [f"{SAMP}::test_sampling_distribution[temperature]"],
        not_on_cuda=CPU_PATH,
    ),
    Mutant(
        "logprobs_after_temperature",
        logprobs_after_temperature,
        [
            f"{CONTRACTS}::test_logprobs_sampled_are_raw_distribution",
            f"{CONTRACTS}::test_logprobs_greedy_match_reference",
        ],
        not_on_cuda=CPU_PATH,
    ),
    Mutant(
        "seed_ignored",
        seed_ignored,
        [f"{SAMP}::test_seeded_requests_reproducible_and_batch_independent"],
        not_on_cuda=CPU_PATH,
    ),
    Mutant(
        "prompt_logprobs_shifted",
        prompt_logprobs_shifted,
        [
            f"{REF}::test_prompt_logprobs_match_reference[qwen2-gqa2-hd64]",
            f"{REF}::test_prefill_decode_consistency[llama-1kv-hd128]",
        ],
    ),
    Mutant("stop_string_kept", stop_string_kept, [CONTRACTS]),
    Mutant("min_tokens_ignored", min_tokens_ignored, [CONTRACTS]),
    Mutant("eos_ignored", eos_ignored, [CONTRACTS]),
    Mutant(
        "mirror_ignores_stop_text",
        mirror_ignores_stop_text,
        ["tests/test_engine_core_process.py::test_process_outputs_equal_thread_outputs[FINAL_ONLY]"],
    ),
    Mutant(
        "merge_pairs_by_position",
        merge_pairs_by_position,
        ["tests/test_async_llm.py::test_merging_pairs_the_completions_of_an_n_request_by_index"],
    ),
    Mutant("outputs_in_finish_order", outputs_in_finish_order, [f"{SELF}::test_outputs_in_input_order", CONTRACTS]),
    Mutant("admission_check_skipped", admission_check_skipped, [CORE_DIR + "test_admission.py"]),
    Mutant(
        "tp_allreduce_skipped",
        tp_allreduce_skipped,
        [CORE_DIR + "test_tensor_parallel.py::test_tp2_equals_tp1_gloo_cpu"],
    ),
    Mutant("async_input_from_wrong_row", async_input_from_wrong_row, [f"{SELF}::test_async_scheduling_equivalence"]),
    Mutant(
        "tp_ranks_sample_apart", tp_ranks_sample_apart, ["tests/test_tp_async.py::test_tp2_async_equals_sync_and_tp1"]
    ),
    Mutant(
        "tp_result_ignores_ticket",
        tp_result_ignores_ticket,
        ["tests/test_tp_async.py::test_tp2_step_abandoned_by_an_interrupt"],
    ),
    Mutant(
        "fp8_load_ignores_scale",
        fp8_load_ignores_scale,
        [
            f"{FP8}::test_round_trip_is_the_nearest_e4m3_value",
            f"{FP8}::test_an_fp8_cache_that_forgets_its_scale_is_rejected",
        ],
        not_on_cuda=CPU_PATH,
    ),
    Mutant(
        "triton_fp8_v_scale_ignored",
        triton_fp8_v_scale_ignored,
        ["tests/gpu/test_kv_cache_fp8_gpu.py", "tests/gpu/test_triton_fp8.py::test_decode_fp8_matches_reference"],
        gpu_only=True,
    ),
    Mutant(
        "cuda_graph_padding_writes_kv", cuda_graph_padding_writes_kv, [CORE_DIR + "test_cuda_graph.py"], gpu_only=True
    ),
    Mutant(
        "fused_sampler_temperature_ignored",
        fused_sampler_temperature_ignored,
        [f"{SAMP}::test_sampling_distribution[temperature]"],
        gpu_only=True,
    ),
    Mutant(
        "philox_seed_ignored",
        philox_seed_ignored,
        [f"{SAMP}::test_seeded_requests_reproducible_and_batch_independent"],
        gpu_only=True,
    ),
    Mutant(
        "triton_decode_drops_last_key",
        triton_decode_drops_last_key,
        [
            f"{REF}::test_greedy_matches_reference[qwen2-gqa2-hd64]",
            f"{REF}::test_prefill_decode_consistency[qwen3-gqa4-hd128]",
        ],
        gpu_only=True,
    ),
    Mutant(
        "fused_qk_norm_k_takes_q_weight",
        fused_qk_norm_k_takes_q_weight,
        [
            f"{REF}::test_greedy_matches_reference[qwen3-gqa4-hd128]",
            f"{REF}::test_prompt_logprobs_match_reference[qwen3-gqa4-hd128]",
        ],
        gpu_only=True,
    ),
    # logits processing and parallel sampling (tests/: against transformers' processors, chi-square)
    Mutant(
        "repetition_penalty_ignores_prompt",
        repetition_penalty_ignores_prompt,
        [f"{LP}::test_repetition_penalty_matches_transformers", GREEDY_OPTS],
    ),
    Mutant(
        "presence_penalty_per_occurrence",
        presence_penalty_per_occurrence,
        [f"{LP}::test_frequency_and_presence_penalties_follow_the_openai_definition", GREEDY_OPTS],
    ),
    Mutant(
        "frequency_penalty_counts_prompt",
        frequency_penalty_counts_prompt,
        [f"{LP}::test_frequency_and_presence_penalties_follow_the_openai_definition", GREEDY_OPTS],
    ),
    Mutant(
        "logit_bias_subtracted", logit_bias_subtracted, [f"{LP}::test_logit_bias_matches_sequence_bias", GREEDY_OPTS]
    ),
    Mutant(
        "allowed_token_ids_last_dropped",
        allowed_token_ids_last_dropped,
        [f"{LP}::test_allowed_token_ids_match_prefix_constrained", GREEDY_OPTS],
    ),
    Mutant(
        "bad_words_prefix_ignored",
        bad_words_prefix_ignored,
        [f"{LP}::test_bad_words_match_no_bad_words_processor", GREEDY_OPTS],
    ),
    Mutant(
        "n_children_share_seed",
        n_children_share_seed,
        [
            f"{PAR}::test_n_completions_follow_the_distribution",
            f"{PAR}::test_seeded_n_is_reproducible_and_child_i_draws_with_seed_plus_i",
        ],
    ),
    Mutant(
        "fused_sampler_skips_processing",
        fused_sampler_skips_processing,
        [f"{LP}::test_rows_with_processing_take_the_general_path_of_the_fused_sampler"],
    ),
]

# issue 10: mutants of the classes the held-out mutants survived in, each with the checks aimed at its class
PFIELDS = CORE_DIR + "test_preemption_fields.py"
BOUNDS = CORE_DIR + "test_boundaries.py"
SAME_STEP = CORE_DIR + "test_prefix_cache_same_step.py"
POLICY = "tests/test_scheduling_policy.py"
PRESSURE = "tests/test_prefix_cache_pressure.py"
STATS = "tests/test_stats_counters.py"
OPTIONS = "tests/test_request_options.py"
PREEMPT_OUT = "tests/test_preemption_outputs.py"
SEEDED = "tests/test_seeded_sampling.py"
_CLASS_MUTANTS = {
    # 3. per-request fields under preemption and re-admission
    "prompt_logprobs_reappended_on_recompute": [PFIELDS, PREEMPT_OUT],
    "output_logprobs_cleared_on_preemption": [PFIELDS, PREEMPT_OUT],
    "cumulative_logprob_reset_on_preemption": [PREEMPT_OUT],
    "seeded_generator_dropped_on_preemption": [PFIELDS, PREEMPT_OUT],
    "first_scheduled_time_every_admission": [PREEMPT_OUT],
    # 4. exact contract boundaries
    "min_tokens_ban_off_by_one": [BOUNDS],
    "stop_string_window_too_narrow": [BOUNDS],
    "stop_string_counts_at_min_tokens": [BOUNDS],
    "prompt_logprobs_chunk_offset_lost": [BOUNDS],
    "logprobs_zero_treated_as_none": [BOUNDS],
    # 5. sampling parameter interplay
    "filters_before_temperature": [SAMP],
    "top_p_mass_before_top_k": [SAMP],
    "first_row_temperature_for_all": [SAMP],
    "top_p_by_position": [SAMP],
    "seeded_generator_not_kept": [SAMP, SEEDED],
    "seed_zero_unseeded": [SAMP],
    # 7. request options at non-defaults
    "chat_always_adds_generation_prompt": [OPTIONS],
    "skip_special_tokens_ignored": [OPTIONS],
    "stop_text_skips_specials": [OPTIONS],
    "decoded_token_of_sampled": [OPTIONS],
    # 9. accounting
    "prompt_tokens_skip_recompute_tail": [STATS, POLICY],
    # the CPU's float32 linear layers (rows kernel)
    "rows_linear_bias_dropped": [ROWS],
    "rows_order_unchecked": [ROWS],
    "lone_row_summed_otherwise": [f"{SELF}::test_batch_invariance_of_logprobs"],
    # the same, over GGUF block formats (rows_quant.c)
    "quant_check_asks_float32": [ROWS_QUANT],
    "quant_segment_ignored": [ROWS_QUANT],
}
ENGINE_MUTANTS += [Mutant(name, getattr(engine_mutants, name), checks) for name, checks in _CLASS_MUTANTS.items()]

# e2e checks for the block-manager / scheduler mutants, on top of their property tests
_CORE_E2E = {
    "free_no_decref": [f"{SELF}::test_preemption_equivalence", f"{SELF}::test_prefix_cache_counter"],
    "publish_before_compute": [f"{SELF}::test_prefix_cache_on_off", f"{SELF}::test_chunked_prefill_equivalence"],
    "hit_skips_token_check": [f"{SELF}::test_prefix_cache_on_off"],
    "full_hit_skips_last_token": [f"{SELF}::test_prefix_cache_on_off", f"{SELF}::test_prefix_cache_counter"],
    "stale_hash_after_eviction": [f"{SELF}::test_prefix_cache_on_off", f"{SELF}::test_preemption_equivalence"],
    "hit_left_in_free_queue": [f"{SELF}::test_prefix_cache_on_off", f"{SELF}::test_preemption_equivalence"],
    "failed_alloc_not_atomic": [f"{SELF}::test_preemption_equivalence"],
    "hash_not_chained": [f"{SELF}::test_prefix_cache_on_off", f"{SELF}::test_prefix_cache_counter"],
    "hash_uses_python_hash": [],
    "budget_off_by_one": [f"{SELF}::test_chunked_prefill_equivalence"],
    "max_num_seqs_off_by_one": [],
    "chunk_boundary_off_by_one": [f"{SELF}::test_chunked_prefill_equivalence"],
    "preempt_keeps_block_table": [f"{SELF}::test_preemption_equivalence"],
    "preempt_oldest": [f"{SELF}::test_preemption_equivalence"],
    "position_after_preemption": [f"{SELF}::test_preemption_equivalence"],
    # issue 10: tight caches over time, same-step twins, queue order and accounting
    "free_head_block_first": [PRESSURE, POLICY],
    "freed_cached_block_to_head": [PRESSURE, POLICY],
    "evict_newest_first": [PRESSURE, POLICY],
    "hits_only_prompt_blocks": [PRESSURE, POLICY],
    "generated_blocks_never_cached": [PRESSURE, POLICY, SAME_STEP],
    "evictions_not_counted": [PRESSURE, POLICY],
    "twin_block_stops_chain": [PRESSURE, SAME_STEP],
    "twin_block_chains_from_own_copy": [PRESSURE, SAME_STEP],
    "twin_check_skips_parent": [PRESSURE],
    "preempted_to_queue_back": [POLICY],
    "admit_in_preempting_step": [POLICY],
    "cache_stats_first_admission_only": [STATS, POLICY],
    "num_cached_tokens_every_admission": [PFIELDS, PREEMPT_OUT, STATS, POLICY],
    "preemptions_not_per_request": [PFIELDS, STATS, POLICY],
}
PROPERTY_FILES = ["tests/properties/test_block_manager_properties.py", "tests/properties/test_scheduler_properties.py"]


def _core_mutants() -> list[Mutant]:
    """The block-manager / scheduler mutants of tests/mutants/core.py."""
    from tests.mutants import core as mutants_core

    props = [f for f in PROPERTY_FILES if (ROOT / f).is_file()]
    out = []
    for name, make in mutants_core.MUTANTS.items():
        # the property tests themselves (not their negative controls, which expect the mutant)
        checks = [f"{f}::-negative" for f in props] + _CORE_E2E.get(name, [SELF])
        out.append(Mutant(name, make, checks, doc=(make.__doc__ or "").strip()))
    return out


def _model_mutants() -> list[Mutant]:
    """The model-reading mutants of tests/mutants/model.py (config fields, GGUF, TP sharding)."""
    from tests.mutants import model as mutants_model

    return [
        Mutant(name, make, checks, doc=(make.__doc__ or "").strip())
        for name, (make, checks) in mutants_model.MUTANTS.items()
    ]


# mutants the CUDA table does not apply, with the reason (the CPU table checks each of them)
_NOT_ON_CUDA = {
    "seed_zero_unseeded": "the CPU's per-request generators; CUDA rows take their seeds in the fused "
    "sampler (seed 0 there: test_seed_zero_is_a_seed runs on CUDA too)",
    "gguf_eps_key_wrong": "the GGUF conversion runs on the host before any device is used",
    "gguf_qk_unpermute_skipped": "the GGUF conversion runs on the host before any device is used",
    "gguf_cache_key_file_only": "the GGUF conversion cache is the host's",
    "rows_linear_bias_dropped": CPU_PATH,
    "rows_order_unchecked": CPU_PATH,
    "lone_row_summed_otherwise": CPU_PATH,
    "quant_check_asks_float32": CPU_PATH,
    "quant_segment_ignored": CPU_PATH,
}


def registry() -> dict[str, Mutant]:
    reg = {m.name: m for m in ENGINE_MUTANTS}
    for m in ENGINE_MUTANTS:
        m.doc = (m.make.__doc__ or "").strip()
    for m in _core_mutants() + _model_mutants():
        reg.setdefault(m.name, m)
    for name, why in _NOT_ON_CUDA.items():
        reg[name].not_on_cuda = why
    return reg


@contextlib.contextmanager
def activate(name: str):
    """Switch mutant ``name`` on in this process, and (through the environment and a wrapped worker
    entry point) in the tensor-parallel workers it starts."""
    reg = registry()
    if name not in reg:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(reg)}")
    saved_env = os.environ.get(ENV)
    os.environ[ENV] = name
    patches = [reg[name].make()]
    try:
        from nanovllm.worker import distributed

        patches.append(_patched((distributed, "_worker_main", _mutant_worker_main)))
    except ImportError:
        pass
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        try:
            yield
        finally:
            if saved_env is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved_env


def _mutant_worker_main(*args, **kwargs):
    """TP worker entry point with the mutant of $NANOVLLM_MUTANT switched on (spawned processes
    re-import everything, so a patch made in the parent does not reach them)."""
    from nanovllm.worker import distributed

    real = distributed._worker_main
    name = os.environ.get(ENV)
    if not name:
        return real(*args, **kwargs)
    with registry()[name].make():
        return real(*args, **kwargs)


# -------------------------------------------------------------------- runner
def _expand(selection: str) -> list[str]:
    """'file::-negative' selects a file's tests except its negative controls (-k)."""
    if selection.endswith("::-negative"):
        return [selection[: -len("::-negative")], "-k", "not negative"]
    return [selection]


def run_mutant(
    m: Mutant, python: str, timeout: float, extra: list[str], threads: int = 1, device: str = "cpu"
) -> tuple[str, list[str], float, str]:
    """(status, checks that failed, seconds, note) for one mutant."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        xml = Path(tmp) / "junit.xml"
        args = [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-p",
            "tests.mutants.plugin",
            "--mutant",
            m.name,
            f"--junitxml={xml}",
            "-o",
            "junit_family=xunit1",
            "--basetemp",
            str(Path(tmp) / "pt"),
        ]
        if any(sel.startswith(CORE_DIR) for sel in m.checks):  # the conformance suite's own options
            args += ["--engine", "nanovllm", "--device", device, "--check-timeout", str(int(timeout * 0.8))]
        for sel in dict.fromkeys(m.checks):
            args += _expand(sel)
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", "quick"),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(threads)),
        )
        env.pop(ENV, None)
        try:
            proc = subprocess.run(args + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "hung", [], time.perf_counter() - start, f"no result within {timeout:.0f} s"
        caught, skipped, total = _failed_tests(xml)
        note = ""
        if total == 0:
            note = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no test ran"]
            note = note[0]
        return ("caught" if caught else "SURVIVED"), caught, time.perf_counter() - start, note


def _failed_tests(xml: Path) -> tuple[list[str], int, int]:
    if not xml.is_file():
        return [], 0, 0
    caught, skipped, total = [], 0, 0
    for case in ET.parse(xml).iter("testcase"):
        total += 1
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            caught.append(name)
        elif case.find("skipped") is not None:
            skipped += 1
    return caught, skipped, total


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run the conformance checks against each injected bug.")
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    ap.add_argument("--list", action="store_true", help="list the mutants and their targeted checks")
    ap.add_argument("--markdown", type=Path, help="also write the table to this file")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device of the conformance checks' engines (cuda: mutants of CPU-only paths are reported not applicable)",
    )
    args, extra = ap.parse_known_args(argv)
    reg = registry()
    names = args.only or list(reg)
    if args.list:
        for n in names:
            print(f"{n}: {reg[n].doc.splitlines()[0] if reg[n].doc else ''}\n    " + "\n    ".join(reg[n].checks))
        return 0
    gpu = _gpu_available()
    if args.device == "cuda" and not gpu:
        ap.error("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")

    def applies(m: Mutant) -> str | None:
        if m.gpu_only and not gpu:
            return "GPU-only mutant: needs a CUDA GPU"
        if m.not_on_cuda and args.device == "cuda":
            return "not applicable on cuda: " + m.not_on_cuda
        return None

    rows = {n: ("not run", [], 0.0, applies(reg[n])) for n in names}
    todo = [reg[n] for n in names if applies(reg[n]) is None]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            m.name: pool.submit(
                run_mutant,
                m,
                sys.executable,
                args.timeout,
                extra,
                max(1, (os.cpu_count() or 1) // args.jobs),
                args.device,
            )
            for m in todo
        }
        for name, fut in futures.items():
            rows[name] = fut.result()
            status, caught, secs, note = rows[name]
            print(f"  {name}: {status} ({secs:.0f} s)", file=sys.stderr, flush=True)
    lines = ["| mutant | result | caught by | seconds |", "| --- | --- | --- | --- |"]
    for n in names:
        status, caught, secs, note = rows[n]
        shown = ", ".join(caught[:6]) + (f" (+{len(caught) - 6} more)" if len(caught) > 6 else "")
        lines.append(f"| {n} | {status} | {shown or note} | {secs:.0f} |")
    table = "\n".join(lines)
    print(table)
    survived = [n for n in names if rows[n][0] not in ("caught", "not run")]
    print(
        f"\n{len(names) - len(survived)}/{len(names)} caught or not applicable here; "
        f"wall time {time.perf_counter() - start:.0f} s" + (f"; SURVIVED: {survived}" if survived else "")
    )
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
