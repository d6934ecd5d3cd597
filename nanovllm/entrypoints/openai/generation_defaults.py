"""Server-wide sampling defaults: what a request gets for a sampling field it leaves out.

vLLM's two flags, with its meanings:
- ``--generation-config auto`` (the default): the model's ``generation_config.json`` (its
  creator's recommended temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens);
  ``vllm``: none of it, the engine's own defaults; a folder: that folder's ``generation_config.json``.
- ``--override-generation-config JSON``: the same keys, over what the first flag gave.

A request's own value always wins; then these defaults; then the endpoint's (``max_tokens``: 16
for /v1/completions as OpenAI's, the rest of the context for chat). ``max_new_tokens`` is
transformers' name for ``max_tokens``. The defaults are checked once, at start-up, by building
SamplingParams from them: a bad value stops the server with the key named.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's key -> SamplingParams' field
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
MODES = ("auto", "vllm")


def _from_file(path: Path) -> dict:
    """The sampling keys of one generation_config.json (none when the file is absent). transformers
    leaves ``do_sample: false`` configs' temperature in the file; like vLLM, it is still taken."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: {str(path)!r} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--generation-config: {str(path)!r} holds {type(raw).__name__}, not a JSON object")
    return {KEYS[k]: v for k, v in raw.items() if k in KEYS and v is not None}


def sampling_defaults(generation_config: str, override: str | None, model_dir: str) -> dict:
    """The defaults (SamplingParams' field names) for ``--generation-config`` and
    ``--override-generation-config``; ValueError naming the flag and the key for a bad one."""
    if generation_config == "auto":
        defaults = _from_file(Path(model_dir) / "generation_config.json")
    elif generation_config == "vllm":
        defaults = {}
    else:
        folder = Path(generation_config).expanduser()
        if not folder.is_dir():
            raise ValueError(
                f"--generation-config must be one of {', '.join(MODES)} or a folder, got {generation_config!r}"
            )
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"--generation-config: {str(folder)!r} has no generation_config.json")
        defaults = _from_file(folder / "generation_config.json")
    if override:
        try:
            extra = json.loads(override)
        except ValueError as e:
            raise ValueError(f"--override-generation-config is not JSON: {e} (got {override!r})") from None
        if not isinstance(extra, dict):
            raise ValueError(f"--override-generation-config must be a JSON object, got {override!r}")
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(
                f"--override-generation-config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(KEYS)}"
            )
        defaults.update({KEYS[k]: v for k, v in extra.items()})
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"server sampling defaults ({_source(generation_config, override)}): {e}") from None
    if defaults:
        logger.warning(
            "requests that leave these sampling fields out get %s (%s; --generation-config vllm for the "
            "engine's defaults)",
            defaults,
            _source(generation_config, override),
        )
    return defaults


def _source(generation_config: str, override: str | None) -> str:
    where = {"auto": "the model's generation_config.json", "vllm": "the engine's defaults"}.get(
        generation_config, f"{generation_config}/generation_config.json"
    )
    return where + (" and --override-generation-config" if override else "")
