"""Every input that names a file or folder takes ``~/...`` as the user's home, as a shell would:
such a value often reaches us unexpanded (quoted on the command line, from a config file, through
the Python API).

Guards against the class "a path-normalisation branch untested": the other tests pass absolute
temporary paths only, so dropping an ``expanduser()`` went unseen. Each case has a negative control:
the same ``~`` value with HOME elsewhere is refused, naming the value (as given or expanded).
"""

from __future__ import annotations

import json

import pytest

from tests.chat_templates import TURN_ENDS


def _chat_template(home):
    (home / "t.jinja").write_text(TURN_ENDS, encoding="utf-8")
    return "~/t.jinja", TURN_ENDS


def _model(home):
    (home / "m").mkdir()
    (home / "m" / "config.json").write_text("{}")
    return "~/m", str(home / "m")


def _generation_config(home):
    (home / "g").mkdir()
    (home / "g" / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    return "~/g", 0.25


def _read(kind: str, value: str):
    if kind == "chat_template":
        from nanovllm.entrypoints.chat_template import load_chat_template

        return load_chat_template(value)
    if kind == "model":
        from nanovllm.loader.model_loader import resolve_model_dir

        return resolve_model_dir(value)
    from nanovllm.entrypoints.openai.generation_defaults import sampling_defaults

    return sampling_defaults(value, None, "")["temperature"]


INPUTS = {"chat_template": _chat_template, "model": _model, "generation_config": _generation_config}


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_a_path_under_the_home_directory_is_expanded(kind, tmp_path, monkeypatch):
    """--chat-template, --model and --generation-config given as ``~/name`` read HOME/name."""
    home = tmp_path / "home"
    home.mkdir()
    value, want = INPUTS[kind](home)
    monkeypatch.chdir(tmp_path)  # a literal "~" folder here would be another path
    monkeypatch.setenv("HOME", str(home))
    assert _read(kind, value) == want
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))  # control: the file is not there
    with pytest.raises((ValueError, FileNotFoundError), match=r"~/|elsewhere"):  # the value as given, or expanded
        _read(kind, value)
