"""The CPU kernels' tests once more, with the kernels built under AddressSanitizer and
UndefinedBehaviorSanitizer (``NANOVLLM_CPU_KERNELS_SANITIZE``), in a child process.

A write a few floats past a buffer's end gives the right answer and corrupts memory nobody compares:
the plain tests see it only where the damage happens to crash the process (a scratch buffer one
group of floats short, in the attention's portable loop, passed them all). Under the sanitizers every
out-of-bounds access, use after free and undefined operation stops the child with a report.

``slow``: the four test files take a few minutes under the sanitizers (``make test-slow``, in CI)."""

from __future__ import annotations

import os
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


def _asan_runtime() -> str:
    cc = cpu_kernels.compiler()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or $CC): the CPU kernels are not built here")
    found = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30)
    path = found.stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.skip(f"{cc} has no AddressSanitizer runtime (libasan.so) to load before Python")
    return path


def _sanitized_env(reports: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(
        # the runtime first (Python itself is not instrumented), then libstdc++, so that the runtime's
        # __cxa_throw interceptor finds the real one (a CUDA build of torch throws while loading:
        # "CHECK failed ... real___cxa_throw" otherwise); leaks: the interpreter's own are many
        LD_PRELOAD=f"{_asan_runtime()}:libstdc++.so.6",
        ASAN_OPTIONS=f"detect_leaks=0:log_path={reports}/asan",
        UBSAN_OPTIONS=f"print_stacktrace=1:log_path={reports}/ubsan",
        NANOVLLM_CPU_KERNELS_SANITIZE=SANITIZERS,
        PYTHONPATH=str(ROOT),
    )
    return env


def _run(args: list[str], reports: Path, timeout: int) -> tuple[subprocess.CompletedProcess, str]:
    """The child's result, and the sanitizers' reports: from their files (a child pytest's capture
    would swallow what a dying process prints) and from its stderr (where a runtime that does not
    take ``log_path`` writes them: seen on a GPU host's Ubuntu gcc)."""
    out = subprocess.run(args, cwd=ROOT, env=_sanitized_env(reports), capture_output=True, text=True, timeout=timeout)
    files = "\n".join(f.read_text(errors="replace")[-6000:] for f in sorted(reports.glob("*san.*")))
    stderr = "\n".join(line for line in out.stderr.splitlines() if "Sanitizer" in line or "runtime error" in line)
    return out, files + stderr


def _skip_without_kernels():
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels could not be built here (no C compiler; see the log)")


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
        f"""
        import ctypes, subprocess, sys
        from nanovllm import cpu_kernels
        assert "-fsanitize={SANITIZERS}" in cpu_kernels.compile_flags(), cpu_kernels.compile_flags()
        lib = "{tmp_path}/overflow.so"
        subprocess.run([cpu_kernels.compiler(), *cpu_kernels.compile_flags(), "{source}", "-o", lib], check=True)
        f = ctypes.CDLL(lib).past_the_end
        f.restype = ctypes.c_float
        print(f(16, int(sys.argv[1])))
        """
    )
    clean_reports, bad_reports = tmp_path / "clean", tmp_path / "bad"
    clean_reports.mkdir()
    bad_reports.mkdir()
    clean, clean_found = _run([sys.executable, "-c", code, "0"], clean_reports, 300)
    assert clean.returncode == 0 and clean.stdout.strip() == "15.0" and not clean_found, clean.stderr + clean_found
    bad, found = _run([sys.executable, "-c", code, "1"], bad_reports, 300)
    # AddressSanitizer's heap overflow, or UBSan's object-size check where it runs first (gcc 13)
    named = "heap-buffer-overflow" in found or "insufficient space" in found
    assert bad.returncode != 0 and named and "overflow.c:5" in found, (bad.returncode, bad.stderr[-2000:], found)


@pytest.mark.slow
def test_the_cpu_kernel_tests_pass_with_the_kernels_sanitized(tmp_path):
    """The kernel tests (attention, elementwise, the rows kernel in float32 and block formats, the
    fused decode layers) pass with every kernel built under the sanitizers, and no report is written."""
    _skip_without_kernels()
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-m", "not slow"]
    out, found = _run([*args, *FILES], tmp_path, 1800)
    tail = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0 and not found, f"exit status {out.returncode}\n{tail}\n{found}"
    assert " passed" in out.stdout and " failed" not in out.stdout, tail
