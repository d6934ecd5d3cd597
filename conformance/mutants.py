"""Injected bugs in nanovllm, and the runner that proves the suite catches each one.

A mutant is a context manager that monkeypatches nanovllm *in the test process*
(class or module attributes; shipped code on disk is never touched); on exit the
original is restored. This registry holds the engine-level mutants (model input,
attention, sampler, output processing, API, tensor parallelism, CUDA graphs) and
includes the block-manager / scheduler mutants of ``conformance/mutants_core.py``.

    python -m conformance.mutants [--only NAME ...] [--jobs N] [--list]

runs, for each mutant, a targeted subset of the checks with ``--mutant NAME``
(conformance/conftest.py switches it on for the whole pytest run, TP workers
included) and prints a table: mutant, checks that caught it. Exit status 1 when
a mutant survives. GPU-only mutants are reported "not run" without a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ContextManager

ENV = "NANOVLLM_MUTANT"
ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _patched(*patches: tuple[object, str, object]):
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


def _modules(*names: str) -> list:
    import importlib
    return [importlib.import_module(n) for n in names]


# --------------------------------------------------------------- model input
def slot_mapping_off_by_one() -> ContextManager:
    """Each token's K/V goes to the next slot of its block (p % bs + 1): attention reads shifted K/V."""
    mi_mod, engine_mod = _modules("nanovllm.engine.model_input", "nanovllm.engine.engine")
    orig = mi_mod.build_model_input

    def build_model_input(out, block_size, finished_seq_ids=None):
        mi = orig(out, block_size, finished_seq_ids)
        mi.slot_mapping = [s - s % block_size + (s % block_size + 1) % block_size for s in mi.slot_mapping]
        return mi
    return _patched((mi_mod, "build_model_input", build_model_input),
                    (engine_mod, "build_model_input", build_model_input))


def min_tokens_ignored() -> ContextManager:
    """Stop tokens are not banned before min_tokens: a stop token can be generated early."""
    mi_mod, engine_mod = _modules("nanovllm.engine.model_input", "nanovllm.engine.engine")
    orig = mi_mod.build_model_input

    def build_model_input(out, block_size, finished_seq_ids=None):
        mi = orig(out, block_size, finished_seq_ids)
        mi.banned_token_ids = [[] for _ in mi.banned_token_ids]
        return mi
    return _patched((mi_mod, "build_model_input", build_model_input),
                    (engine_mod, "build_model_input", build_model_input))


# ----------------------------------------------------------------- attention
def decode_drops_last_key() -> ContextManager:
    """Batched decode attention masks the newest key (seq_len - 1): the token never sees itself."""
    (torch_ref,) = _modules("nanovllm.attention.torch_ref")
    orig = torch_ref.paged_decode_batched

    def paged_decode_batched(q, k_cache, v_cache, meta, scale):
        lens = (meta.seq_lens - 1).clamp(min=1)
        meta = dataclasses.replace(meta, seq_lens=lens, seq_lens_cpu=[max(1, s - 1) for s in meta.seq_lens_cpu])
        return orig(q, k_cache, v_cache, meta, scale)
    return _patched((torch_ref, "paged_decode_batched", paged_decode_batched))


def prefill_mask_top_left() -> ContextManager:
    """The causal mask of a prefill chunk is aligned top-left: after cached or earlier-chunk tokens a
    query sees only as many keys as its index in the chunk (right only when nothing is cached)."""
    import torch

    (torch_ref,) = _modules("nanovllm.attention.torch_ref")
    orig = torch_ref.attention_one_seq

    def attention_one_seq(q, k, v, scale):
        n_q, n_k = q.shape[0], k.shape[0]
        if n_q == 1 or n_q == n_k:
            return orig(q, k, v, scale)
        out = torch.empty_like(q)
        for j in range(n_q):  # query j sees keys 0..j only (should be 0..n_k - n_q + j)
            out[j:j + 1] = orig(q[j:j + 1], k[:j + 1], v[:j + 1], scale)
        return out
    return _patched((torch_ref, "attention_one_seq", attention_one_seq))


# ------------------------------------------------------------------- sampler
def top_p_one_too_few() -> ContextManager:
    """top_p drops the token that crosses the threshold (inclusive cumulative mass)."""
    import torch

    (sampler,) = _modules("nanovllm.layers.sampler")

    def apply_top_k_top_p(logits, top_k, top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass = probs.cumsum(dim=-1)  # the bug: should be the mass *before* each token
        drop = (mass >= top_p.unsqueeze(1)) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return _patched((sampler, "apply_top_k_top_p", apply_top_k_top_p))


def top_k_one_too_many() -> ContextManager:
    """top_k keeps k + 1 tokens."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    orig = sampler.apply_top_k_top_p

    def apply_top_k_top_p(logits, top_k, top_p):
        return orig(logits, top_k + (top_k > 0).to(top_k.dtype), top_p)
    return _patched((sampler, "apply_top_k_top_p", apply_top_k_top_p))


def min_p_absolute() -> ContextManager:
    """min_p is applied as an absolute probability, not relative to the most likely token."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    import torch

    def apply_min_p(logits, min_p):
        probs = torch.softmax(logits, dim=-1)
        return logits.masked_fill(probs < min_p.unsqueeze(1), float("-inf"))
    return _patched((sampler, "apply_min_p", apply_min_p))


def temperature_ignored() -> ContextManager:
    """Random rows sample at temperature 1 whatever was asked."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    orig = sampler.Sampler._sample

    def _sample(self, logits, meta, rows):
        meta = dataclasses.replace(meta, temperatures=[1.0 if t >= 1e-5 else t for t in meta.temperatures])
        return orig(self, logits, meta, rows)
    return _patched((sampler.Sampler, "_sample", _sample))


def logprobs_after_temperature() -> ContextManager:
    """Returned logprobs are those of the temperature-scaled distribution, not the raw model's."""
    import torch

    (sampler,) = _modules("nanovllm.layers.sampler")
    orig = sampler.Sampler.__call__

    def __call__(self, logits, meta):
        out = orig(self, logits, meta)
        for row, entry in enumerate(out.logprobs):
            t = meta.temperatures[row]
            if entry is None or t < 1e-5:
                continue
            lp = torch.log_softmax(logits[row].float() / t, dim=-1)
            tok = out.token_ids[row]
            k = len(entry[2])
            vals, ids = lp.topk(max(k, 1))
            top = list(zip(ids[:k].tolist(), vals[:k].tolist())) if k else []
            out.logprobs[row] = (float(lp[tok]), int((lp > lp[tok]).sum()) + 1, top)
        return out
    return _patched((sampler.Sampler, "__call__", __call__))


def seed_ignored() -> ContextManager:
    """Seeded requests draw from the engine's shared generator: not reproducible, batch-dependent."""
    (runner,) = _modules("nanovllm.engine.model_runner")
    orig = runner.ModelRunner._sampling_metadata

    def _sampling_metadata(self, mi):
        meta = orig(self, mi)
        meta.generators = [None] * len(meta.generators)
        return meta
    return _patched((runner.ModelRunner, "_sampling_metadata", _sampling_metadata))


def prompt_logprobs_shifted() -> ContextManager:
    """Prompt logprobs are reported one position late (each position gets its successor's)."""
    (runner,) = _modules("nanovllm.engine.model_runner")
    orig = runner.ModelRunner._prompt_logprobs

    def _prompt_logprobs(self, hidden, mi):
        results = orig(self, hidden, mi)
        return [rows[1:] + rows[-1:] for rows in results]
    return _patched((runner.ModelRunner, "_prompt_logprobs", _prompt_logprobs))


# ------------------------------------------------------- output processing, API
def stop_string_kept() -> ContextManager:
    """The stop string is left in the output text although include_stop_str_in_output is False."""
    op, engine_mod = _modules("nanovllm.engine.output_processor", "nanovllm.engine.engine")
    orig = op.check_stop

    def check_stop(seq, tokenizer, max_model_len):
        saved = seq.params.include_stop_str_in_output
        seq.params.include_stop_str_in_output = True
        try:
            orig(seq, tokenizer, max_model_len)
        finally:
            seq.params.include_stop_str_in_output = saved
    return _patched((op, "check_stop", check_stop), (engine_mod, "check_stop", check_stop))


def eos_ignored() -> ContextManager:
    """The model's EOS ids never stop a request (only explicit stop_token_ids do)."""
    (sp,) = _modules("nanovllm.sampling_params")

    def all_stop_token_ids(self):
        return set(self.stop_token_ids)
    return _patched((sp.SamplingParams, "all_stop_token_ids", all_stop_token_ids))


def outputs_in_finish_order() -> ContextManager:
    """LLM.generate returns the shortest outputs first (finish order), not input order."""
    (llm_mod,) = _modules("nanovllm.llm")
    orig = llm_mod.LLM.generate

    def generate(self, *args, **kwargs):
        return sorted(orig(self, *args, **kwargs), key=lambda o: len(o.outputs[0].token_ids))
    return _patched((llm_mod.LLM, "generate", generate))


def admission_check_skipped() -> ContextManager:
    """Requests that can never fit are accepted (no admission control)."""
    (sched,) = _modules("nanovllm.engine.scheduler")
    return _patched((sched.Scheduler, "check_admissible", lambda self, seq: None))


# ------------------------------------------------------- tensor parallel, GPU
def tp_allreduce_skipped() -> ContextManager:
    """Row-parallel layers and the vocabulary-parallel embedding skip their all-reduce (each rank
    keeps its partial sum). Patched inside the TP worker processes (see _worker_main)."""
    linear, embedding = _modules("nanovllm.layers.linear", "nanovllm.layers.embedding")
    return _patched((linear, "all_reduce", lambda x: x), (embedding, "all_reduce", lambda x: x))


def cuda_graph_padding_writes_kv() -> ContextManager:
    """Decode-graph padding rows get slot 0 instead of -1: replaying a padded batch overwrites the
    K/V of whichever sequence owns slot 0 (GPU only)."""
    (si,) = _modules("nanovllm.engine.step_inputs")
    orig = si.StepInputs.stage

    def stage(self, mi, pad_to=None):
        step = orig(self, mi, pad_to=pad_to)
        if pad_to is not None and pad_to > len(mi.slot_mapping):
            step.meta.slot_mapping[len(mi.slot_mapping):pad_to].fill_(0)
        return step
    return _patched((si.StepInputs, "stage", stage))


# ------------------------------------------------------------------ registry
@dataclass
class Mutant:
    name: str
    make: Callable[[], ContextManager]
    checks: list[str]                 # pytest selections (node ids under conformance/) that should catch it
    gpu_only: bool = False
    doc: str = field(default="")


CORE_DIR = "conformance/"
REF = CORE_DIR + "test_reference.py"
SELF = CORE_DIR + "test_self_consistency.py"
SAMP = CORE_DIR + "test_sampling.py"
CONTRACTS = CORE_DIR + "test_contracts.py"

ENGINE_MUTANTS: list[Mutant] = [
    Mutant("slot_mapping_off_by_one", slot_mapping_off_by_one,
           [f"{REF}::test_greedy_matches_reference[qwen3-gqa4-hd128]",
            f"{REF}::test_prompt_logprobs_match_reference[llama-1kv-hd128]"]),
    Mutant("decode_drops_last_key", decode_drops_last_key,
           [f"{REF}::test_greedy_matches_reference[qwen2-gqa2-hd64]",
            f"{REF}::test_prefill_decode_consistency[qwen3-gqa4-hd128]"]),
    Mutant("prefill_mask_top_left", prefill_mask_top_left,  # invisible without chunks or cache hits
           [f"{REF}::test_greedy_matches_reference[llama-mha-hd64]",
            f"{SELF}::test_chunked_prefill_equivalence[17]", f"{SELF}::test_prefix_cache_on_off"]),
    Mutant("top_p_one_too_few", top_p_one_too_few, [f"{SAMP}::test_sampling_distribution[top_p]"]),
    Mutant("top_k_one_too_many", top_k_one_too_many, [f"{SAMP}::test_sampling_distribution[top_k]"]),
    Mutant("min_p_absolute", min_p_absolute, [f"{SAMP}::test_sampling_distribution[min_p]"]),
    Mutant("temperature_ignored", temperature_ignored, [f"{SAMP}::test_sampling_distribution[temperature]"]),
    Mutant("logprobs_after_temperature", logprobs_after_temperature,
           [f"{CONTRACTS}::test_logprobs_sampled_are_raw_distribution",
            f"{CONTRACTS}::test_logprobs_greedy_match_reference"]),
    Mutant("seed_ignored", seed_ignored,
           [f"{SAMP}::test_seeded_requests_reproducible_and_batch_independent"]),
    Mutant("prompt_logprobs_shifted", prompt_logprobs_shifted,
           [f"{REF}::test_prompt_logprobs_match_reference[qwen2-gqa2-hd64]",
            f"{REF}::test_prefill_decode_consistency[llama-1kv-hd128]"]),
    Mutant("stop_string_kept", stop_string_kept, [CONTRACTS]),
    Mutant("min_tokens_ignored", min_tokens_ignored, [CONTRACTS]),
    Mutant("eos_ignored", eos_ignored, [CONTRACTS]),
    Mutant("outputs_in_finish_order", outputs_in_finish_order,
           [f"{SELF}::test_outputs_in_input_order", CONTRACTS]),
    Mutant("admission_check_skipped", admission_check_skipped, [CORE_DIR + "test_admission.py"]),
    Mutant("tp_allreduce_skipped", tp_allreduce_skipped,
           [CORE_DIR + "test_tensor_parallel.py::test_tp2_equals_tp1_gloo_cpu"]),
    Mutant("cuda_graph_padding_writes_kv", cuda_graph_padding_writes_kv,
           [CORE_DIR + "test_cuda_graph.py"], gpu_only=True),
]

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
}
PROPERTY_FILES = [CORE_DIR + "test_block_manager_properties.py", CORE_DIR + "test_scheduler_properties.py"]


def _core_mutants() -> list[Mutant]:
    """The block-manager / scheduler mutants of conformance/mutants_core.py, where it exists."""
    try:
        from conformance import mutants_core
    except ImportError:  # the property-test work has not landed: nothing to add
        return []
    props = [f for f in PROPERTY_FILES if (ROOT / f).is_file()]
    out = []
    for name, make in mutants_core.MUTANTS.items():
        # the property tests themselves (not their negative controls, which expect the mutant)
        checks = [f"{f}::-negative" for f in props] + _CORE_E2E.get(name, [SELF])
        out.append(Mutant(name, make, checks, doc=(make.__doc__ or "").strip()))
    return out


def registry() -> dict[str, Mutant]:
    reg = {m.name: m for m in ENGINE_MUTANTS}
    for m in ENGINE_MUTANTS:
        m.doc = (m.make.__doc__ or "").strip()
    for m in _core_mutants():
        reg.setdefault(m.name, m)
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
        from nanovllm.engine import distributed
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
    from nanovllm.engine import distributed

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


def run_mutant(m: Mutant, python: str, timeout: float, extra: list[str],
               threads: int = 1) -> tuple[str, list[str], float, str]:
    """(status, checks that failed, seconds, note) for one mutant."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        xml = Path(tmp) / "junit.xml"
        args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--mutant", m.name,
                "--engine", "nanovllm", f"--junitxml={xml}", "--check-timeout", str(int(timeout * 0.8)),
                "-o", "junit_family=xunit1", "--basetemp", str(Path(tmp) / "pt")]
        for sel in dict.fromkeys(m.checks):
            args += _expand(sel)
        env = dict(os.environ, PYTHONPATH=str(ROOT), HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", "quick"),
                   OMP_NUM_THREADS=str(threads))
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
    args, extra = ap.parse_known_args(argv)
    reg = registry()
    names = args.only or list(reg)
    if args.list:
        for n in names:
            print(f"{n}: {reg[n].doc.splitlines()[0] if reg[n].doc else ''}\n    " + "\n    ".join(reg[n].checks))
        return 0
    gpu = _gpu_available()
    todo = [reg[n] for n in names if gpu or not reg[n].gpu_only]
    rows = {n: ("not run", [], 0.0, "GPU-only mutant: needs a CUDA GPU") for n in names}
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {m.name: pool.submit(run_mutant, m, sys.executable, args.timeout, extra,
                                         max(1, (os.cpu_count() or 1) // args.jobs)) for m in todo}
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
    print(f"\n{len(names) - len(survived)}/{len(names)} caught or not applicable here; "
          f"wall time {time.perf_counter() - start:.0f} s" + (f"; SURVIVED: {survived}" if survived else ""))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
