"""`nanovllm bench`: one workload, nanovllm and its peers in the same run, a table of ratios.

``run_bench`` is four steps: ``setup_target`` (the workload, model and engine arguments),
``run_ours`` (nanovllm, ``--repeat`` times, the median), ``run_peer`` per ``--peer`` (each
peer's own figures, or its own line saying it failed and why), and ``report`` (the table, the
roofline on GPU shapes, ``--json-out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from nanovllm.bench import peers
from nanovllm.bench.args import PEERS, SELF_PEER, add_bench_args  # noqa: F401  (re-exported)
from nanovllm.bench.datasets import build_workload, resolve_name
from nanovllm.bench.json_out import device_name, run_meta
from nanovllm.bench.json_out import write_json as write_strict_json
from nanovllm.bench.lengths import check_fits, max_model_len
from nanovllm.bench.roofline import KNOWN_DEVICES, Roofline, device_limits, roofline
from nanovllm.bench.workloads import SHAPES, Workload, shape_config_dir

logger = logging.getLogger(__name__)


@dataclass
class Target:
    """What is measured: the workload, the model and how every engine loads it."""

    workload: Workload
    model_dir: str
    model_label: str
    load_format: str  # "dummy": random weights (a GPU shape)
    engine_args: dict
    device: str
    dtype: torch.dtype
    shape: dict | None = None  # the GPU shape, for the roofline

    @property
    def random_weights(self) -> bool:
        return self.load_format == "dummy"


@dataclass
class PeerResult:
    """One peer's outcome: its measurements, or why it has none."""

    peer: str
    measurements: list[peers.Measurement] = field(default_factory=list)
    failed: str | None = None  # "ExceptionType: message"
    skipped: str | None = None

    def lines(self) -> list[str]:
        """Progress lines for stderr: the peer's own figures, never another engine's."""
        if self.failed is not None:
            return [f"  {self.peer}: failed: {self.failed}"]
        if self.skipped is not None:
            return [f"  {self.peer}: skipped ({self.skipped})"]
        out = []
        for m in self.measurements:
            out += [f"  {m.engine} run {i}: {m.output_tokens / s:.1f} tok/s" for i, s in enumerate(m.runs, 1)]
            out.append(f"  {m.engine}: {m.tokens_per_s:.1f} tok/s" + (f" ({m.note})" if m.runs else ""))
        return out


def _vocab_size(model_dir: str) -> int | None:
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "vocab_size", None)


def _tokenizer(model_dir: str):
    loaded: list = []  # the tokenizer, loaded on first use

    def tokenize(text: str) -> list[int]:
        if not loaded:
            from transformers import AutoTokenizer

            loaded.append(AutoTokenizer.from_pretrained(model_dir))
        return loaded[0](text)["input_ids"]

    return tokenize


def setup_target(args: argparse.Namespace) -> Target:
    from nanovllm.entrypoints.args import engine_kwargs
    from nanovllm.loader.model_loader import resolve_model_dir

    name = resolve_name(args.dataset, args.input_len, torch.cuda.is_available())
    eargs = engine_kwargs(args)
    shape = None
    if name == "gpu":
        shape = None if args.model else SHAPES[args.shape]
        model_dir = args.model or shape_config_dir(args.shape)
        load_format, label = ("auto", args.model) if args.model else ("dummy", f"{args.shape} shape")
        eargs.setdefault("max_model_len", 4096)
        device, dtype = "cuda", torch.bfloat16
    else:
        model_dir = resolve_model_dir(args.model)
        load_format, label = "auto", args.model or "default"
        eargs.setdefault("dtype", "float32")
        device, dtype = "cpu", torch.float32
    w = build_workload(
        name,
        args.num_prompts,
        args.input_len,
        args.output_len,
        _vocab_size(model_dir),
        None if load_format == "dummy" else _tokenizer(model_dir),
    )
    return Target(w, model_dir, label, load_format, eargs, device, dtype, shape)


def run_repeated(
    target: Target, engine_args: dict, args: argparse.Namespace, name: str, label: str, first_run: bool = False
) -> list[peers.Measurement]:
    """nanovllm with ``engine_args`` ``--repeat`` times: the median row (``label``) first, then
    the ``--warm`` rows. ``first_run``: the first run also takes ``--warm`` and ``--profile-steps``."""
    runs, extra = [], []
    for i in range(args.repeat):
        first = first_run and i == 0
        ms = peers.run_nanovllm(
            target.workload,
            target.model_dir,
            engine_args,
            target.load_format,
            warm_repeat=first and args.warm,
            profile=first and args.profile_steps,
        )
        runs.append(ms[0])
        extra += ms[1:]
        print(f"  {name} run {i + 1}: {ms[0].tokens_per_s:.1f} tok/s", file=sys.stderr)
    median_s = statistics.median(m.seconds for m in runs)
    note = f"median of {len(runs)}" if len(runs) > 1 else ""
    return [peers.Measurement(label, runs[0].output_tokens, median_s, note)] + extra


def run_ours(target: Target, args: argparse.Namespace) -> list[peers.Measurement]:
    """nanovllm ``--repeat`` times: the median row first, then the ``--warm`` rows."""
    return run_repeated(target, target.engine_args, args, "nanovllm", "nanovllm", first_run=True)


def target_device_name(target: Target) -> str:
    return device_name(target.device)


def target_roofline(target: Target, engine_args: dict) -> Roofline | None:
    """The workload's limit on this GPU for these engine arguments (an FP8 KV cache reads one
    byte per element); None without a GPU shape or for a GPU whose rates were not measured."""
    if not target.shape:
        return None
    device = device_limits(target_device_name(target))
    if device is None:
        return None
    fp8 = str(engine_args.get("kv_cache_dtype", "auto")).startswith("fp8")
    tp = engine_args.get("tensor_parallel_size", 1)
    return roofline(target.workload, target.shape, device, tp=tp, kv_bytes_per_elem=1 if fp8 else None)


def run_peer(peer: str, target: Target, args: argparse.Namespace) -> PeerResult:
    """One peer on the target's workload; an exception becomes a failed PeerResult."""
    w, t = target.workload, target
    try:
        n = args.peer_repeat
        if peer == "hf":
            runs = [peers.run_hf_generate(w, t.model_dir, t.device, t.dtype, t.random_weights) for _ in range(n)]
            return PeerResult(peer, [peers.median_run(runs)])
        if peer == "hf-cb":
            runs = [
                peers.run_hf_continuous_batching(w, t.model_dir, t.device, t.dtype, t.random_weights) for _ in range(n)
            ]
            return PeerResult(peer, [peers.median_run(runs)])
        if peer == "vllm":
            python = peers.find_vllm_python(args.vllm_python)
            if python is None:
                return PeerResult(peer, skipped="no vLLM virtual env found; pass --vllm-python")
            dtype = str(t.dtype).removeprefix("torch.")
            return PeerResult(peer, peers.run_vllm(w, t.model_dir, python, dtype=dtype, repeat=n))
        if peer.startswith(SELF_PEER):
            return PeerResult(peer, run_self_peer(peer, target, args))
        raise ValueError(f"--peer {peer!r}: not one of {', '.join(PEERS)}")
    except Exception as e:
        logger.info("peer %s failed", peer, exc_info=True)  # the whole message (--log-level INFO)
        return PeerResult(peer, failed=one_line(f"{type(e).__name__}: {e}"))


def engine_overrides(peer: str) -> dict:
    """``nanovllm:kv_cache_dtype=fp8,max_num_seqs=128`` -> {"kv_cache_dtype": "fp8", "max_num_seqs": 128}:
    keys are engine arguments, values JSON (numbers, true/false, null) or else strings."""
    from nanovllm.config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "hf_config", "model_dir"}
    out: dict = {}
    for item in peer.removeprefix(SELF_PEER).split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(
                f"--peer {peer!r}: {item!r} is not ENGINE_ARG=VALUE (engine arguments: {', '.join(sorted(names))})"
            )
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run_self_peer(peer: str, target: Target, args: argparse.Namespace) -> list[peers.Measurement]:
    """nanovllm with some engine arguments changed, ``--repeat`` times (the median), in this process."""
    overrides = engine_overrides(peer)
    eargs = {**target.engine_args, **overrides}
    label = "nanovllm (" + ", ".join(f"{k}={v}" for k, v in overrides.items()) + ")"
    measured = run_repeated(target, eargs, args, peer, label)
    limit = target_roofline(target, eargs)
    if limit is not None and limit != target_roofline(target, target.engine_args):
        print(f"  {label} roofline: {limit.describe()}", file=sys.stderr)
    return measured


def one_line(text: str) -> str:
    """A multi-line error (a subprocess's traceback) as one line: its first and last lines."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) <= 1 else f"{lines[0]} ... {lines[-1]}"


def check_workload_fits(target: Target, args: argparse.Namespace) -> None:
    """Every prompt fits the engine's max_model_len, and with --input-len or --output-len (lengths
    the user fixed) its whole output too; before any engine loads the model (bench/lengths.py)."""
    w = target.workload
    if not w.prompts:
        return
    whole = args.input_len is not None or args.output_len is not None
    i = max(range(len(w.prompts)), key=lambda i: len(w.prompts[i]) + (w.max_tokens[i] if whole else 0))
    fixed = (("--input-len", args.input_len), ("--output-len", args.output_len))
    flags = (
        " ".join(f"{flag} {value}" for flag, value in fixed if value is not None) if whole else f"--dataset {w.name}"
    )
    check_fits(
        max_model_len(target.model_dir, target.engine_args),
        len(w.prompts[i]),
        w.max_tokens[i],
        f"request {i} of workload {w.name!r} ({flags})",
        whole,
    )


def run_bench(args: argparse.Namespace) -> int:
    target = setup_target(args)
    check_workload_fits(target, args)
    w = target.workload
    print(
        f"workload {w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt tokens, "
        f"{w.num_output_tokens} output tokens; model {target.model_label}",
        file=sys.stderr,
    )
    ours = run_ours(target, args)
    outcomes = []
    for peer in args.peer:
        outcome = run_peer(peer, target, args)
        for line in outcome.lines():
            print(line, file=sys.stderr)
        outcomes.append(outcome)
    report(target, ours, outcomes, target_roofline(target, target.engine_args), args.json_out)
    return 0


def report(
    target: Target,
    ours: list[peers.Measurement],
    outcomes: list[PeerResult],
    limit: Roofline | None,
    json_out: str | None,
) -> None:
    results = ours + [m for o in outcomes for m in o.measurements]
    unmeasured = target_device_name(target) if target.shape and limit is None else None
    print_table(results, ours[0], limit, [o for o in outcomes if not o.measurements], unmeasured)
    if json_out:
        write_json(json_out, target, results, outcomes, limit)


def print_table(
    results: list[peers.Measurement],
    ours: peers.Measurement,
    limit: Roofline | None,
    missing: Sequence[PeerResult] = (),
    device_name: str | None = None,
) -> None:
    """``device_name``: a GPU whose limit is not known (said in place of the roofline)."""
    print("\n| engine | output tok/s | seconds | nanovllm / engine |")
    print("| --- | ---: | ---: | ---: |")
    for m in results:
        ratio = f"{ours.tokens_per_s / m.tokens_per_s:.2f}x" if m.output_tokens else "n/a (no tokens)"
        print(f"| {m.engine} | {m.tokens_per_s:,.1f} | {m.seconds:.2f} | {ratio} |")
    for o in missing:
        why = f"failed: {o.failed}" if o.failed is not None else f"skipped: {o.skipped}"
        print(f"| {o.peer} | {why.replace('|', '/')} | - | - |")
    if limit is not None:
        print(f"\nroofline: {limit.describe()}")
        print(f"nanovllm reaches {ours.tokens_per_s / limit.output_tokens_per_s:.1%} of the physical limit")
    elif device_name is not None:
        known = ", ".join(d.name for d in KNOWN_DEVICES)
        print(
            f"\nroofline: not known for {device_name!r} (measured: {known}); measure its rates with "
            "scripts/hbm_bandwidth.py --matmul and add them to nanovllm/bench/roofline.py"
        )


def write_json(
    path: str, target: Target, results: list[peers.Measurement], outcomes: list[PeerResult], limit: Roofline | None
) -> None:
    rows = [
        {
            "engine": m.engine,
            "output_tokens": m.output_tokens,
            "seconds": m.seconds,
            "tokens_per_s": m.tokens_per_s,
            "note": m.note,
            **({"runs_seconds": list(m.runs)} if m.runs else {}),
        }
        for m in results
    ]
    rows += [{"engine": o.peer, "failed": o.failed, "skipped": o.skipped} for o in outcomes if not o.measurements]
    write_strict_json(
        path,
        {
            "meta": run_meta("throughput", target.engine_args, target.device),
            "workload": target.workload.name,
            "roofline_tokens_per_s": limit.output_tokens_per_s if limit else None,
            "roofline_device": asdict(limit.device) if limit else None,
            "results": rows,
        },
    )
