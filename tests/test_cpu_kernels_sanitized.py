"""The CPU kernels' tests once more, with the kernels built under AddressSanitizer and
UndefinedBehaviorSanitizer (``NANOVLLM_CPU_KERNELS_SANITIZE``), in a child process.

A write a few floats past a buffer's end gives the right answer and corrupts memory nobody compares:
the plain tests see it only where the damage happens to crash the process (a scratch buffer one
group of floats short, in the attention's portable loop, passed them all). Under the sanitizers every
out-of-bounds access, use after free and undefined operation stops the child with a report.

``slow``: the four test files take a few minutes under the sanitizers (``make test-slow``, in CI)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nanovllm import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent
FILES = [
    "tests/test_cpu_kernels.py",
    "tests/test_cpu_rows_linear.py",
    "tests/test_cpu_rows_quant.py",
    "tests/test_cpu_fused_decode.py",
]
SANITIZERS = "address,undefined"


def _runtimes() -> str:
    """LD_PRELOAD for the child: the AddressSanitizer runtime first (Python is not instrumented), then
    the libstdc++ this process has loaded (torch's), so that the runtime's ``__cxa_throw``
    interceptor finds the real one: a CUDA build of torch throws while loading ("CHECK failed ...
    real___cxa_throw" otherwise)."""
    cc = cpu_kernels.compiler()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or $CC): the CPU kernels are not built here")
    found = []
    for runtime in ("libasan.so", "libubsan.so"):
        path = subprocess.run([cc, f"-print-file-name={runtime}"], capture_output=True, text=True, timeout=30)
        path = path.stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            pytest.skip(f"{cc} has no {runtime} (the sanitizers' runtime) for the kernels' sanitized build")
        found.append(path)
    maps = Path("/proc/self/maps").read_text().split()
    stdcxx = next((word for word in maps if "/libstdc++.so" in word), "libstdc++.so.6")
    return f"{found[0]}:{stdcxx}"


def _sanitized_env(reports: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(
        LD_PRELOAD=_runtimes(),
        ASAN_OPTIONS=f"detect_leaks=0:log_path={reports}/asan",  # the interpreter's own leaks are many
        UBSAN_OPTIONS=f"print_stacktrace=1:log_path={reports}/ubsan",
        NANOVLLM_CPU_KERNELS_SANITIZE=SANITIZERS,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        CUDA_VISIBLE_DEVICES="",  # CPU kernels only: no CUDA start-up under the sanitizers
    )
    return env


def _run(args: list[str], reports: Path, timeout: int) -> tuple[str, str, int | None, str]:
    """The child's stdout, stderr and exit status (None: stopped at ``timeout``), and the sanitizers'
    reports: from their files (a child pytest's capture would swallow what a dying process prints)
    and from its stderr (where a runtime that does not take ``log_path`` writes them: seen on a GPU
    host's Ubuntu gcc)."""
    try:
        out = subprocess.run(
            args, cwd=ROOT, env=_sanitized_env(reports), capture_output=True, text=True, timeout=timeout
        )
        stdout, stderr, status = out.stdout, out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        text = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (e.stdout, e.stderr)]
        stdout, stderr, status = text[0], text[1], None
    files = [f.read_text(errors="replace")[-6000:] for f in sorted(reports.glob("*san.*"))]
    lines = [line for line in stderr.splitlines() if "Sanitizer" in line or "runtime error" in line]
    return stdout, stderr, status, "\n".join(files + lines)


def _skip_without_kernels():
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels could not be built here (no C compiler; see the log)")


def test_a_sanitized_build_is_refused_where_it_would_end_the_process(monkeypatch):
    """Loaded without its runtime preloaded, an AddressSanitizer library ends the process: the kernels
    step aside instead (PyTorch runs), naming the variable; a value that names no sanitizer is
    refused too. Control: no value, no refusal."""
    monkeypatch.delenv(cpu_kernels.SANITIZE, raising=False)
    assert cpu_kernels.sanitize_refusal() is None
    monkeypatch.setenv(cpu_kernels.SANITIZE, "1")
    assert "NANOVLLM_CPU_KERNELS_SANITIZE='1': a comma-separated list of" in cpu_kernels.sanitize_refusal()
    if "libasan" not in Path("/proc/self/maps").read_text():
        monkeypatch.setenv(cpu_kernels.SANITIZE, "address")
        assert "preloaded (LD_PRELOAD=libasan.so)" in cpu_kernels.sanitize_refusal()
        code = "from nanovllm import cpu_kernels; print(cpu_kernels.load() is None)"
        env = dict(os.environ, NANOVLLM_CPU_KERNELS_SANITIZE="address")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_the_sanitized_build_reports_a_write_past_a_buffer(tmp_path):
    """Negative control for the run below: the same build flags, runtime and report files, on a
    library that writes one float past a malloc'd buffer, stop the child with a report naming the
    write's line; the same library without the write runs clean."""
    _skip_without_kernels()
    source = tmp_path / "overflow.c"
    source.write_text(
        textwrap.dedent(
            """
            #include <stdlib.h>
            float past_the_end(int n, int extra) {
                float *x = malloc(sizeof(float) * n);
                for (int i = 0; i < n + extra; i++) x[i] = (float)i;
                float s = x[n - 1];
                free(x);
                return s;
            }
            """
        )
    )
    code = textwrap.dedent(
        """
        import ctypes, subprocess, sys
        from nanovllm import cpu_kernels
        assert "-fsanitize=address,undefined" in cpu_kernels.compile_flags(), cpu_kernels.compile_flags()
        assert cpu_kernels.sanitize_refusal() is None, cpu_kernels.sanitize_refusal()
        source, lib, extra = sys.argv[1:]
        subprocess.run([cpu_kernels.compiler(), *cpu_kernels.compile_flags(), source, "-o", lib], check=True)
        f = ctypes.CDLL(lib).past_the_end
        f.restype = ctypes.c_float
        print(f(16, int(extra)))
        """
    )
    for name in ("clean", "bad"):
        (tmp_path / name).mkdir()
    lib = str(tmp_path / "overflow.so")
    stdout, stderr, status, found = _run([sys.executable, "-c", code, str(source), lib, "0"], tmp_path / "clean", 300)
    assert status == 0 and stdout.strip() == "15.0" and not found, stderr[-2000:] + found
    stdout, stderr, status, found = _run([sys.executable, "-c", code, str(source), lib, "1"], tmp_path / "bad", 300)
    # AddressSanitizer's heap overflow, or UBSan's object-size check where it runs first (gcc 13)
    named = "heap-buffer-overflow" in found or "insufficient space" in found
    assert status not in (0, None) and named and "overflow.c:5" in found, (status, stderr[-2000:], found)


@pytest.mark.slow
def test_the_cpu_kernel_tests_pass_with_the_kernels_sanitized(tmp_path):
    """The kernel tests (attention, elementwise, the rows kernel in float32 and block formats, the
    fused decode layers) pass with every kernel built under the sanitizers, and no report is written.
    Each file must have run tests of its own: a file that skipped whole (its kernels unavailable
    under the sanitized build) would leave nothing checked."""
    _skip_without_kernels()
    reports = tmp_path / "reports"
    reports.mkdir()
    args = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:xdist", "-p", "no:cacheprovider"]
    args += ["-m", "not slow", f"--basetemp={tmp_path / 'child'}", *FILES]
    stdout, stderr, status, found = _run(args, reports, 1800)
    tail = stdout[-3000:] + stderr[-3000:]
    assert status == 0 and not found, f"exit status {status} (None: stopped after 1800 s)\n{tail}\n{found}"
    ran = {f: stdout.count(f"PASSED {f}::") for f in FILES}
    summary = stdout.strip().splitlines()[-1]
    assert all(ran.values()) and " passed" in summary and not re.search(r"\d+ (failed|errors?)\b", summary), (ran, tail)
