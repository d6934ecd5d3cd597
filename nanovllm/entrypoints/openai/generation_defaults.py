"""Server-wide sampling defaults: what a request gets for a sampling field it leaves out.

vLLM's two flags, with its meanings:
- ``--generation-config auto`` (the default): the model's ``generation_config.json`` (its
  creator's recommended temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens),
  as vLLM reads it: only the values that differ from transformers' own defaults (a file that
  spells out ``"top_k": 50`` sets nothing); ``vllm``: none of it, the engine's own defaults; a
  folder: that folder's ``generation_config.json``.
- ``--override-generation-config JSON``: the same keys, over what the first flag gave; a key set
  to null removes the file's value.

temperature, top_p, top_k, min_p and repetition_penalty are defaults: a request's own value wins.
``max_new_tokens`` is a server-wide *limit* (vLLM's documented meaning): a request gets at most
that many tokens, whatever its ``max_tokens`` (so an operator's limit holds), and within it the
endpoint's default (16 for /v1/completions, OpenAI's; the rest of the context for chat). The
defaults are checked once, at start-up, by building SamplingParams from them: a bad value stops
the server with the key named.
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
# transformers' GenerationConfig defaults of those keys: a file's value equal to one is not a
# recommendation (vLLM reads the file's difference from these, ``to_diff_dict``)
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
HINT = "--generation-config vllm leaves the model's file out"


def _from_file(path: Path) -> dict:
    """The sampling keys of one generation_config.json (none when the file is absent). transformers
    leaves ``do_sample: false`` configs' temperature in the file; like vLLM, it is still taken."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: {str(path)!r} is not readable JSON: {e} ({HINT})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--generation-config: {str(path)!r} holds {type(raw).__name__}, not a JSON object ({HINT})")
    return {
        KEYS[k]: v
        for k, v in raw.items()
        if k in KEYS and v is not None and not (k in TRANSFORMERS_DEFAULTS and v == TRANSFORMERS_DEFAULTS[k])
    }


def sampling_defaults(generation_config: str, override: str | None, model_dir: str) -> dict:
    """The defaults (SamplingParams' field names) for ``--generation-config`` and
    ``--override-generation-config``; ValueError naming the flag and the key for a bad one."""
    if generation_config == "auto":
        defaults = _from_file(Path(model_dir) / "generation_config.json")
    elif generation_config == "vllm":
        defaults = {}
    else:
        folder = Path(generation_config).expanduser()
        if folder.is_file() and folder.name == "generation_config.json":  # the file itself: its folder
            folder = folder.parent
        if not folder.is_dir():
            raise ValueError(
                f"--generation-config must be one of {', '.join(MODES)} or a folder, got {generation_config!r}"
            )
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"--generation-config: {str(folder)!r} has no generation_config.json")
        defaults = _from_file(folder / "generation_config.json")
    file = None  # the file, named as a source (and with the way out of it) only where it gave some
    if defaults:
        file = "the model's generation_config.json" if generation_config == "auto" else generation_config
    source = " and ".join(x for x in (file, "--override-generation-config" if override else None) if x)
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
        for k, v in extra.items():
            if v is None:  # null: no value for this key (the file's removed)
                defaults.pop(KEYS[k], None)
            else:
                defaults[KEYS[k]] = v
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        names = {v: k for k, v in KEYS.items()}  # the message in the file's names (max_new_tokens)
        message = " ".join(names.get(w, w) for w in str(e).split(" "))
        raise ValueError(f"server sampling defaults ({source}): {message}{f'; {HINT}' if file else ''}") from None
    if defaults:
        logger.warning(
            "sampling defaults for requests that leave the field out (max_tokens: a limit on every request): "
            "%s, from %s%s",
            defaults,
            source,
            f" ({HINT})" if file else "",
        )
    return defaults
