"""The requests a benchmark runs, from `vllm bench`-style flags: ``--dataset`` (a workload by
name, or a JSONL file), ``--num-prompts``, ``--input-len``, ``--output-len``.

Named datasets: ``cpu`` and ``gpu`` (the standard workloads of workloads.py), ``random``
(``--num-prompts`` prompts of ``--input-len`` token ids drawn uniformly below the model's
vocabulary size, seed 0; vLLM's ``random`` dataset) and ``auto`` (``random`` when
``--input-len`` is given, else ``gpu`` with CUDA, else ``cpu``). A JSONL file holds one request
per line: ``{"prompt": "text"}`` (tokenized with the model's tokenizer) or
``{"prompt_token_ids": [...]}``, with an optional ``"max_tokens"``.

``--num-prompts N`` keeps the first N requests (a named workload then no longer has the standard
totals); ``--output-len`` sets every request's output length (``ignore_eos``: exactly that many).
Torch-free: imported by the CLI's argument code.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from nanovllm.bench.workloads import Workload, cpu_workload, gpu_workload

NAMED = ("auto", "cpu", "gpu", "random")
RANDOM_DEFAULTS = {"num_prompts": 32, "input_len": 128, "output_len": 128}
JSONL_DEFAULT_OUTPUT_LEN = 128


def resolve_name(dataset: str, input_len: int | None, cuda: bool) -> str:
    """``auto`` made concrete; a name that is neither a dataset nor a .jsonl path is an error."""
    if dataset == "auto":
        return "random" if input_len is not None else ("gpu" if cuda else "cpu")
    if dataset in NAMED or dataset.endswith(".jsonl"):
        return dataset
    raise ValueError(f"--dataset {dataset!r}: not one of {', '.join(NAMED)} and not a .jsonl file")


def positive(flag: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def random_workload(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    return Workload("random", prompts, [output_len] * num_prompts, 0.0, vocab_size=vocab_size)


def jsonl_workload(
    path: str, output_len: int | None, tokenize: Callable[[str], list[int]] | None, vocab_size: int | None = None
) -> Workload:
    """One request per line; an error names the file, the line and the field."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise FileNotFoundError(f"--dataset {path!r}: {e.strerror}") from None
    prompts, max_tokens = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset {path!r} line {number}"
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(req, dict):
            raise ValueError(f"{where}: expected an object, got {type(req).__name__}")
        if "prompt_token_ids" in req:
            ids = req["prompt_token_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
                raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of token ids, got {ids!r}")
            if vocab_size is not None and max(ids) >= vocab_size:
                raise ValueError(
                    f"{where}: prompt_token_ids holds id {max(ids)}, the model's vocabulary has {vocab_size}"
                )
        elif isinstance(req.get("prompt"), str) and req["prompt"]:
            if tokenize is None:
                raise ValueError(f"{where}: a text prompt needs a model with a tokenizer; give prompt_token_ids")
            ids = tokenize(req["prompt"])
        else:
            raise ValueError(f'{where}: needs "prompt" (non-empty text) or "prompt_token_ids", got keys {sorted(req)}')
        n = output_len if output_len is not None else req.get("max_tokens", JSONL_DEFAULT_OUTPUT_LEN)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{where}: max_tokens must be a positive integer, got {n!r}")
        prompts.append(ids)
        max_tokens.append(n)
    if not prompts:
        raise ValueError(f"--dataset {path!r}: no requests (one JSON object per line)")
    return Workload(Path(path).name, prompts, max_tokens, 0.0, vocab_size=vocab_size)


def build_workload(
    name: str,
    num_prompts: int | None,
    input_len: int | None,
    output_len: int | None,
    vocab_size: int | None,
    tokenize: Callable[[str], list[int]] | None = None,
) -> Workload:
    """The workload for a resolved dataset name (``resolve_name``) and the length flags."""
    for flag, value in (("--num-prompts", num_prompts), ("--input-len", input_len), ("--output-len", output_len)):
        positive(flag, value)
    if name == "random":
        if vocab_size is None:
            raise ValueError("--dataset random needs the model's vocab_size (config.json)")
        d = RANDOM_DEFAULTS
        return random_workload(
            num_prompts or d["num_prompts"], input_len or d["input_len"], output_len or d["output_len"], vocab_size
        )
    if input_len is not None:
        raise ValueError(
            f"--input-len applies to --dataset random, not --dataset {name!r} (got --input-len {input_len})"
        )
    if name in ("cpu", "gpu"):
        w = cpu_workload() if name == "cpu" else gpu_workload()
        w.check_totals()
        w.vocab_size = vocab_size
        if vocab_size is not None and max(max(p) for p in w.prompts) >= vocab_size:
            raise ValueError(
                f"--dataset {name}: its token ids reach {max(max(p) for p in w.prompts)}, "
                f"the model's vocabulary has {vocab_size}; use --dataset random"
            )
    else:
        w = jsonl_workload(name, output_len, tokenize, vocab_size)
    if num_prompts is not None:
        if num_prompts > len(w.prompts):
            raise ValueError(f"--num-prompts {num_prompts}: --dataset {name!r} has {len(w.prompts)} requests")
        w.prompts, w.max_tokens = w.prompts[:num_prompts], w.max_tokens[:num_prompts]
    if output_len is not None:
        w.max_tokens = [output_len] * len(w.prompts)
    if num_prompts is not None or output_len is not None:
        w.expected_prompt_tokens = w.expected_output_tokens = None  # no longer the standard workload
        tags = [f"first {num_prompts}"] * (num_prompts is not None) + [f"output {output_len}"] * (
            output_len is not None
        )
        w.name = f"{w.name} ({', '.join(tags)})"
    return w
