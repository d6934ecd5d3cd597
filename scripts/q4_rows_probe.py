"""Probe: the CPU decode products reading Q4_1 blocks (dequantized in registers) against the float32
strips the rows kernel reads now. SmolLM2-135M's four products a layer (q/k/v 960x576, o 576x576,
gate/up 3072x576, down 576x1536), 30 layers, weights streamed from memory (425 MB as float32), at
decode row counts, 2 threads; each figure the median of 5 passes. The two give the same bits
(checked first): the weight is ``(d * q) + m`` in float32, as gguf dequantizes Q4_1.

    python3 scripts/q4_rows_probe.py          # AVX-512 only; builds q4_rows_probe.c with gcc

An exploratory measurement for docs/KERNEL_NOTES.md (session 34), not the engine's code.
"""

from __future__ import annotations

import ctypes
import pathlib
import statistics
import subprocess
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) per layer
LAYERS = 30


def build() -> ctypes.CDLL:
    out = pathlib.Path(tempfile.mkdtemp()) / "q4_rows_probe.so"
    cmd = ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(HERE / "q4_rows_probe.c"), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(out))


def q4_weights(n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_1 weights: (the float32 values gguf would give, packed [n][k]; the probe's packing)."""
    blocks = k // 32
    d = rng.uniform(0.001, 0.05, (n, blocks)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.4, 0.0, (n, blocks)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    w = (d.repeat(32, axis=1) * q.astype(np.float32)) + m.repeat(32, axis=1)  # two roundings, as gguf
    packed = bytearray()
    for s in range(n // 16):
        cols = slice(16 * s, 16 * s + 16)
        for b in range(blocks):
            packed += d[cols, b].tobytes() + m[cols, b].tobytes()
            qb = q[cols, 32 * b : 32 * b + 32].T  # [32 k][16 columns]
            packed += (qb[:, 0::2] | (qb[:, 1::2] << 4)).astype(np.uint8).tobytes()
    return w.astype(np.float32), np.frombuffer(bytes(packed), dtype=np.uint8)


def strips_f32(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    return np.ascontiguousarray(w.reshape(n // 16, 16, k).transpose(0, 2, 1))


def ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def main() -> None:
    lib = build()
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, k in SHAPES:
            w, q4 = q4_weights(n, k, rng)
            layer.append((n, k, strips_f32(w), q4))
        layers.append(layer)
    f32_bytes = sum(f.nbytes for layer in layers for _, _, f, _ in layer)
    q4_bytes = sum(q.nbytes for layer in layers for _, _, _, q in layer)
    print(f"weights: float32 {f32_bytes / 1e6:.0f} MB, Q4_1 probe layout {q4_bytes / 1e6:.0f} MB")
    for rows in (1, 4):  # the same bits first
        for n, k, f, q in layers[0]:
            x = rng.standard_normal((rows, k)).astype(np.float32)
            a, b = np.zeros((rows, n), np.float32), np.zeros((rows, n), np.float32)
            lib.probe_f32(ptr(x), ptr(f), ptr(a), rows, n, k, 2)
            lib.probe_q4(ptr(x), ptr(q), ptr(b), rows, n, k, 2)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (rows, n, k)
            lib.probe_q4_once(ptr(x), ptr(q), ptr(b), rows, n, k, 2)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (rows, n, k)
    print("bitwise equal: float32 strips and Q4_1 dequantized (both ways), 1 and 4 rows, one layer")
    print(
        "| rows | float32 strips (ms, 30 layers) | Q4_1 per row tile (ms) | speed-up | Q4_1 once per strip (ms) | speed-up |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in (1, 2, 4, 8, 16, 32):
        xs = {k: rng.standard_normal((rows, k)).astype(np.float32) for _, k in SHAPES}
        ys = {n: np.zeros((rows, n), np.float32) for n, _ in SHAPES}
        times: dict[str, list[float]] = {"f32": [], "q4": [], "once": []}
        for rep in range(6):  # the first pass untimed: every page touched, the code warm
            for name, fn, idx in (("f32", lib.probe_f32, 2), ("q4", lib.probe_q4, 3), ("once", lib.probe_q4_once, 3)):
                t = time.perf_counter()
                for layer in layers:
                    for entry in layer:
                        n, k = entry[0], entry[1]
                        fn(ptr(xs[k]), ptr(entry[idx]), ptr(ys[n]), rows, n, k, 2)
                if rep:
                    times[name].append(time.perf_counter() - t)
        f, q, o = (statistics.median(times[name]) * 1e3 for name in ("f32", "q4", "once"))
        print(f"| {rows} | {f:.2f} | {q:.2f} | {f / q:.2f}x | {o:.2f} | {f / o:.2f}x |")


if __name__ == "__main__":
    main()
