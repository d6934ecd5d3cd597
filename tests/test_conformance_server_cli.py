"""python -m conformance.server: its --help explains the command's placeholders, and a bad
--model-path or --serve gets one line before anything starts; the server log it made goes away
after a run that passed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conformance import server

ROOT = Path(__file__).resolve().parent.parent


def test_help_explains_the_placeholders():
    out = subprocess.run(
        [sys.executable, "-m", "conformance.server", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 0
    assert all(w in out.stdout for w in ("{model}", "{port}", "{python}", "golden:NAME")), out.stdout


@pytest.mark.parametrize(
    "model_path, words",
    [
        ("golden:nope", ["--model-path golden:nope: 'nope' is not a golden model; known: llama-1kv-hd128"]),
        ("/no/such", ["--model-path /no/such: no such file or directory"]),
    ],
)
def test_a_bad_model_path_is_refused_up_front(model_path, words):
    with pytest.raises(SystemExit) as e:
        server.main(["--serve", "true", "--port", "1", "--model-path", model_path])
    assert all(w in str(e.value.code) for w in words), e.value.code


def test_control_a_golden_model_resolves():
    assert Path(server.resolve_model("golden-source:llama-mha-hd64")).exists()


def test_a_missing_server_program_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        with server.served("no-such-server-binary --port 1", "http://127.0.0.1:1/v1", tmp_path / "log"):
            pass
    assert (
        str(e.value.code)
        == "--serve: cannot start 'no-such-server-binary': No such file or directory (is it installed and on PATH?)"
    )


def test_the_temporary_log_goes_after_a_run_that_passed(monkeypatch, tmp_path, capsys):
    """A fake server (this Python serving /v1/models) and a fake suite run: the default log is
    removed when the run passes, kept and named when it fails."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ok = subprocess.CompletedProcess([], 0)
    monkeypatch.setattr(server.subprocess, "run", lambda *a, **k: ok)
    serve = "{python} -m http.server {port} --bind 127.0.0.1 --directory " + str(tmp_path / "root")
    (tmp_path / "root" / "v1").mkdir(parents=True)
    (tmp_path / "root" / "v1" / "models").write_text("{}")
    port = str(18000 + os.getpid() % 1000)
    args = ["--serve", serve, "--port", port, "--model-path", str(tmp_path), "--ready-timeout", "60"]
    assert server.main(args) == 0
    assert not list(tmp_path.glob("conformance-server-*.log"))
    ok.returncode = 1  # control: a failed run keeps the log and says where
    assert server.main(args) == 1
    kept = list(tmp_path.glob("conformance-server-*.log"))
    assert len(kept) == 1 and f"server log: {kept[0]}" in capsys.readouterr().err
