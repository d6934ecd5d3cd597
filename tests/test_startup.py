"""Start-up imports only what the path needs (timings are measured in BENCHMARKS.md, not here):
the CLI's help imports no torch; a CPU engine imports neither transformers nor Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conformance.zoo import zoo_model

CHECK = "import sys, json; print(json.dumps({m: m in sys.modules for m in ('torch', 'transformers', 'triton')}))"


def _modules_after(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", f"{code}\n{CHECK}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["bench", "--help"]])
def test_help_imports_no_torch(argv):
    code = (
        "import contextlib, io\nfrom nanovllm.entrypoints.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main({argv!r})"
    )
    assert _modules_after(code)["torch"] is False


def test_generate_help_builds_no_serving_benchmark():
    """Building the CLI parser leaves out `bench serve`'s asyncio and HTTP client (every command
    pays for what the parser imports); `bench serve` itself still runs them."""
    code = (
        "import contextlib, io, sys\nfrom nanovllm.entrypoints.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main(['generate', '--help'])\n"
        "print('asyncio' in sys.modules, 'nanovllm.bench.serve' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], f"asyncio, bench.serve imported: {out.stdout}"


def test_cpu_engine_imports_neither_transformers_nor_triton():
    model = zoo_model("qwen3-gqa2-hd64-tied")
    code = (
        f"from nanovllm import LLM, SamplingParams\nllm = LLM({model!r}, device='cpu', threads=1)\n"
        "llm.chat([{'role': 'user', 'content': 'w5 w6'}], SamplingParams(max_tokens=2), use_tqdm=False)"
    )
    assert _modules_after(code) == {"torch": True, "transformers": False, "triton": False}


def test_the_check_sees_an_import():
    """Negative control: the same check reports a module that was imported."""
    assert _modules_after("import transformers")["transformers"] is True


def test_threads_flag_and_default(monkeypatch):
    from nanovllm import cpu_threads
    from nanovllm.config import EngineConfig
    from nanovllm.cpu_threads import default_threads, physical_cores
    from nanovllm.entrypoints.args import engine_kwargs
    from nanovllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "--threads", "3", "hi"])
    assert engine_kwargs(args)["threads"] == 3
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        EngineConfig(threads=0)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert default_threads() == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(cpu_threads, "_watch", None)  # no load watch running (a CLI test may have left one)
    assert default_threads() == physical_cores() >= 1


def test_physical_cores_counts_cores_not_hyperthreads(tmp_path):
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):  # two cores, two hardware threads each
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text("0\n")
    from nanovllm.cpu_threads import physical_cores

    assert physical_cores({0, 1, 2, 3}, sysfs=tmp_path) == 2
    assert physical_cores({0, 2}, sysfs=tmp_path) == 1
    assert physical_cores({0, 1, 2, 3}, sysfs=tmp_path / "absent") == 4  # no topology: the CPU count


def test_physical_cores_counts_each_sockets_cores(tmp_path):
    """Two sockets number their cores alike (core_id 0 and 1 on each): four cores, not two."""
    for cpu, (package, core) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (1, 1))):  # 4, 5: hyperthreads
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text(f"{package}\n")
    from nanovllm.cpu_threads import physical_cores

    assert physical_cores(set(range(6)), sysfs=tmp_path) == 4
    assert physical_cores({0, 2}, sysfs=tmp_path) == 2


def _generate_then_exit(main_call: str) -> list[str]:
    """stdout of a process that runs ``generate`` through ``main_call``, with an atexit function
    and an object whose finaliser reports the interpreter's shutdown."""
    model = zoo_model("qwen3-gqa2-hd64-tied")
    code = (
        "import atexit, sys\nfrom nanovllm.entrypoints.cli import main\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "class Witness:\n    def __del__(self):\n        print('finalised', flush=True)\n"
        "witness = Witness()\n"
        f"argv = ['generate', '--model', {model!r}, '--no-progress', '--threads', '1', '--max-tokens', '2', 'w5 w6']\n"
        f"sys.argv = ['nanovllm', *argv]\nsys.exit({main_call})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_generate_command_exits_without_finalisation():
    """The `nanovllm generate` command (main() without argv) ends the process once its results are
    printed: the atexit functions run, the interpreter's tear-down of every object does not."""
    lines = _generate_then_exit("main()")
    assert len(lines) == 2 and lines[0], lines  # the completion, then the atexit line
    assert lines[1] == "atexit ran"


def test_main_with_argv_returns():
    """Negative control: main(argv) (a caller in Python: the tests, an embedding program) returns,
    and the process exits normally: the finaliser runs."""
    lines = _generate_then_exit("main(argv)")
    assert lines[-2:] == ["atexit ran", "finalised"], lines


def test_file_hash_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """The GGUF cache key's hash is computed once per file version: a second start-up reads the
    remembered digest; a changed file (new size and modification time) is hashed again."""
    import hashlib
    import os

    from nanovllm.loader import cache

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    hashed = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p: hashed.append(p) or real(p))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"first")
    assert cache.remembered_sha256(f) == hashlib.sha256(b"first").hexdigest() and len(hashed) == 1
    assert cache.remembered_sha256(f) == hashlib.sha256(b"first").hexdigest() and len(hashed) == 1
    f.write_bytes(b"second version")
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a later mtime even on a coarse clock
    assert cache.remembered_sha256(f) == hashlib.sha256(b"second version").hexdigest() and len(hashed) == 2


def _same_size_rewrite(f):
    """New bytes of the same size, in place (same inode), with a later modification time."""
    f.write_bytes(b"BBBB")
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _touch_only(f):
    """Same bytes, same inode, a later modification time (a file rewritten with equal content)."""
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _replaced_same_size_same_mtime(f):
    """Another file of the same size and modification time renamed over it (a new inode)."""
    st = os.stat(f)
    new = f.with_name("new.tmp")
    new.write_bytes(b"CCCC")
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, f)


def _resized_same_mtime(f):
    """New bytes of another size, in place, with the old modification time put back."""
    st = os.stat(f)
    f.write_bytes(b"DDDDDD")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def _moved(f):
    """The same bytes under another path (another resolved path)."""
    st = os.stat(f)
    other = f.with_name("moved.gguf")
    other.write_bytes(f.read_bytes())
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    return other


@pytest.mark.parametrize(
    "change", [_same_size_rewrite, _touch_only, _replaced_same_size_same_mtime, _resized_same_mtime, _moved]
)
def test_each_identity_field_alone_makes_the_file_hashed_again(change, tmp_path, monkeypatch):
    """The remembered hash is keyed by path, inode, size and modification time: a change of any
    ONE of them (the others kept) hashes the file again, and the digest is the new content's.
    Guards against the class "an identity/key test that changes several fields at once" (a
    same-size rewrite kept the stale digest and so the stale GGUF conversion). Negative control:
    the file rewritten with its own bytes and its old modification time put back keeps its memo
    (the hash count shows what happened)."""
    import hashlib

    from nanovllm.loader import cache

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    hashed = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p: hashed.append(p) or real(p))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"AAAA")
    assert cache.remembered_sha256(f) == hashlib.sha256(b"AAAA").hexdigest() and len(hashed) == 1
    st = os.stat(f)
    f.write_bytes(b"AAAA")  # control: identity unchanged (same inode, size, mtime)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.remembered_sha256(f) == hashlib.sha256(b"AAAA").hexdigest() and len(hashed) == 1
    target = change(f) or f
    assert cache.remembered_sha256(target) == hashlib.sha256(target.read_bytes()).hexdigest()
    assert len(hashed) == 2, f"{change.__name__}: the remembered digest was reused"


def _mapped_file(address: int) -> str | None:
    """The file whose mapping holds ``address`` in this process ('' for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_cpu_weights_are_not_copied_from_the_checkpoint():
    """A whole parameter with the checkpoint's dtype takes the safetensors file's mapping itself
    (no allocation, no copy); a merged one (q/k/v in one matrix) is assembled in memory."""
    from nanovllm.config import EngineConfig
    from nanovllm.loader.model_loader import load_hf_config, resolve_model_dir
    from nanovllm.worker.model_runner import ModelRunner

    config = EngineConfig.from_kwargs(zoo_model("qwen3-gqa2-hd64-tied"), device="cpu", dtype="float32", threads=1)
    model_dir = resolve_model_dir(config.model)
    config.resolve(load_hf_config(model_dir), model_dir)
    runner = ModelRunner(config)
    layer = runner.model.model.layers[0]
    weights = {
        "o_proj": layer.self_attn.o_proj.weight,
        "down_proj": layer.mlp.down_proj.weight,
        "embedding": runner.model.model.embed_tokens.weight,
        "qkv_proj (merged)": layer.self_attn.qkv_proj.weight,
    }
    where = {name: _mapped_file(w.data_ptr()) for name, w in weights.items()}
    assert all(str(where[n]).endswith(".safetensors") for n in ("o_proj", "down_proj", "embedding")), where
    assert not str(where["qkv_proj (merged)"]).endswith(".safetensors"), where  # the check tells them apart


def test_parser_reads_each_dataclass_source_once(monkeypatch):
    """Building the CLI parser parses EngineConfig's and SamplingParams' sources once each (their
    field docstrings are every flag's help), not once per subcommand that adds their flags."""
    import inspect

    from nanovllm.entrypoints import args as cli_args
    from nanovllm.entrypoints.cli import build_parser

    read = []
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: read.append(obj) or real(obj))
    cli_args._field_docs.cache_clear()
    build_parser()
    assert sorted(c.__name__ for c in read) == ["EngineConfig", "SamplingParams"]
    cli_args._field_docs.cache_clear()  # negative control: a cleared cache reads the source again
    cli_args.field_docs(cli_args.EngineConfig)
    assert len(read) == 3


def test_busy_cpu_seconds_reads_the_usable_cpus(tmp_path):
    import os

    from nanovllm.cpu_threads import busy_cpu_seconds

    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    stat.write_text(
        f"cpu  {9 * hz} 0 0 0 0 0 0 0\ncpu0 {hz} {hz} {hz} {50 * hz} {7 * hz} 0 0 {hz}\ncpu1 {5 * hz} 0 0 0 0 0 0 0\n"
    )
    assert busy_cpu_seconds({0}, stat) == 4.0
    assert busy_cpu_seconds({0, 1}, stat) == 9.0
    assert busy_cpu_seconds({0}, tmp_path / "absent") is None


@pytest.mark.parametrize(("others_busy", "threads"), [(0.9, 1), (0.2, 2), (None, 2)])
def test_default_threads_leaves_out_cores_busy_elsewhere(monkeypatch, others_busy, threads):
    """Over a 1 s watch, other processes used ``others_busy`` of 2 CPUs (this process 1 CPU):
    a busy core is left out; a little background use is not (the negative control); unwatched,
    the physical cores as before."""
    from nanovllm import cpu_threads as ct

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(ct, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(ct, "physical_cores", lambda cpus=None: 2)
    clock = {"now": 100.0, "busy": 500.0, "own": 3.0}
    monkeypatch.setattr(ct.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(ct, "busy_cpu_seconds", lambda cpus: clock["busy"])
    monkeypatch.setattr(ct, "own_cpu_seconds", lambda: clock["own"])
    monkeypatch.setattr(ct, "_watch", None)
    if others_busy is not None:
        ct.watch_other_load()
        clock.update(now=101.0, busy=500.0 + 1.0 + others_busy, own=4.0)
    assert ct.default_threads() == threads
    assert ct.default_threads() == 2, "the watch serves one engine: a later one must not reuse a stale window"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an explicit setting wins over the measurement
    assert ct.default_threads() == 3


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--no-progress", "--max-tokens", "1", "w5"],
        ["experiment", "04", "--threads", "1", "--out", "{tmp}"],
        ["trace", "--html", "{tmp}/t.html", "--max-tokens", "1", "w5"],
    ],
    ids=["generate", "experiment", "trace"],
)
def test_commands_watch_the_load_before_importing_torch(command, tmp_path):
    """The watch spans torch's import (the start-up's longest second), so it starts before it: in
    every command that runs a model for a person at a terminal (a learner's experiment on a busy
    2-core machine took 46-50 s on the 2 threads it chose, 2.7 s on 1)."""
    model = zoo_model("qwen3-gqa2-hd64-tied")
    argv = [command[0], "--model", model, *(a.replace("{tmp}", str(tmp_path)) for a in command[1:])]
    code = (
        "import contextlib, io, sys\nfrom nanovllm.entrypoints.cli import main\nimport nanovllm.cpu_threads as ct\n"
        "real, seen = ct.watch_other_load, []\n"
        "def spy():\n    seen.append('torch' in sys.modules)\n    real()\n"
        "ct.watch_other_load = spy\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = main({argv!r})\n"
        "print('torch imported before the watch:', seen, 'after:', 'torch' in sys.modules, 'status', status)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch imported before the watch: [False] after: True status 0", out.stdout


@pytest.mark.parametrize(
    ("argv", "imported"), [(["generate", "--help"], False), (["bench", "--help"], True), (["--help"], True)]
)
def test_generate_builds_only_its_own_parser(argv, imported):
    """`generate` builds its parser alone: the other subcommands' modules (their flags) are not
    imported; a parser with every subcommand imports them (the check sees an import)."""
    code = (
        "import contextlib, io, sys\nfrom nanovllm.entrypoints.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main({argv!r})\n"
        "print(sorted(m for m in ('nanovllm.bench.args', 'nanovllm.experiments.runner', 'nanovllm.trace_html',"
        " 'nanovllm.entrypoints.openai.cli_args') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    others = json.loads(out.stdout.strip().replace("'", '"'))
    assert (len(others) == 4) if imported else (others == []), others
