"""Each tensor-parallel layer, with every feature it has (biases included), against the plain
full-weight computation, on 2 gloo ranks on the CPU.

The model-level TP tests (tests/test_tp.py) only reach a layer feature that one of their models
has: a row-parallel bias added on every rank before the all-reduce (counted tp times) passed
them all while no TP-tested model had an o_proj / down_proj bias. Here every layer kind is built
with a bias, loaded through its ``weight_loader`` from full checkpoint tensors (so the sharding
is checked too) and compared with ``F.linear`` / ``F.embedding`` on those full tensors. The
embedding and LM head use an odd vocabulary and look up the ids on both sides of the shard
boundary (a ``<=`` for ``<`` in the rank mask looks one id up on two ranks).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback

import torch

WORLD = 2
TOL = 1e-5
HIDDEN, INTER, HEAD_DIM, HEADS, VOCAB = 16, 24, 4, 4, 11  # VOCAB odd: 6 rows a rank, the last one padded


def _full_tensors() -> dict[str, torch.Tensor]:
    """The checkpoint tensors, the same on every rank (a fixed seed). Biases of std 1: a bias
    counted twice or dropped moves every output by ~1, far past TOL."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g)

    kv1, kv2 = HEAD_DIM, 2 * HEAD_DIM  # one KV head (replicated on both ranks), two (split)
    return {
        "x": t(3, HIDDEN),
        "x_inter": t(3, INTER),
        "col.w": t(INTER, HIDDEN),
        "col.b": t(INTER),
        "gate.w": t(INTER, HIDDEN),
        "gate.b": t(INTER),
        "up.w": t(INTER, HIDDEN),
        "up.b": t(INTER),
        "q.w": t(HEADS * HEAD_DIM, HIDDEN),
        "q.b": t(HEADS * HEAD_DIM),
        "k1.w": t(kv1, HIDDEN),
        "k1.b": t(kv1),
        "v1.w": t(kv1, HIDDEN),
        "v1.b": t(kv1),
        "k2.w": t(kv2, HIDDEN),
        "k2.b": t(kv2),
        "v2.w": t(kv2, HIDDEN),
        "v2.b": t(kv2),
        "row.w": t(HIDDEN, INTER),
        "row.b": t(HIDDEN),
        "emb.w": t(VOCAB, HIDDEN),
    }


def _boundary_ids() -> torch.Tensor:
    """0, the last id of each rank's shard, the first of the next, and the last id."""
    per_rank = -(-VOCAB // WORLD)
    ids = {0, VOCAB - 1}
    for k in range(1, WORLD):
        ids |= {k * per_rank - 1, k * per_rank}
    return torch.tensor(sorted(ids))


def _layer_outputs(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(this rank's output, the expected output) of every layer, in a process whose TP group is up."""
    import torch.nn.functional as F

    from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from nanovllm.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    w = _full_tensors()
    x = w["x"]
    out = {}

    def load(param, tensor, *shard):
        param.weight_loader(param, tensor, "test", *shard)

    def cols(full: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's slice of ``n`` column-parallel output features."""
        size = n // WORLD
        return full[..., rank * size : (rank + 1) * size]

    col = ColumnParallelLinear(HIDDEN, INTER, bias=True)
    load(col.weight, w["col.w"])
    load(col.bias, w["col.b"])
    out["column"] = (col(x), cols(F.linear(x, w["col.w"], w["col.b"]), INTER))

    merged = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=True)
    for shard, name in enumerate(("gate", "up")):
        load(merged.weight, w[f"{name}.w"], shard)
        load(merged.bias, w[f"{name}.b"], shard)
    gate = cols(F.linear(x, w["gate.w"], w["gate.b"]), INTER)
    up = cols(F.linear(x, w["up.w"], w["up.b"]), INTER)
    out["merged column (gate/up)"] = (merged(x), torch.cat([gate, up], -1))

    for kv_heads in (1, 2):  # 1: replicated on both ranks; 2: one per rank
        qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, kv_heads, bias=True)
        for shard in ("q", "k", "v"):
            name = shard if shard == "q" else f"{shard}{kv_heads}"
            load(qkv.weight, w[f"{name}.w"], shard)
            load(qkv.bias, w[f"{name}.b"], shard)
        q = cols(F.linear(x, w["q.w"], w["q.b"]), HEADS * HEAD_DIM)
        k = F.linear(x, w[f"k{kv_heads}.w"], w[f"k{kv_heads}.b"])
        v = F.linear(x, w[f"v{kv_heads}.w"], w[f"v{kv_heads}.b"])
        if kv_heads >= WORLD:
            k, v = cols(k, kv_heads * HEAD_DIM), cols(v, kv_heads * HEAD_DIM)
        out[f"qkv ({kv_heads} KV heads)"] = (qkv(x), torch.cat([q, k, v], -1))

    row = RowParallelLinear(INTER, HIDDEN, bias=True)
    load(row.weight, w["row.w"])
    load(row.bias, w["row.b"])
    x_inter = w["x_inter"]
    out["row"] = (row(cols(x_inter, INTER).contiguous()), F.linear(x_inter, w["row.w"], w["row.b"]))

    ids = _boundary_ids()
    emb = VocabParallelEmbedding(VOCAB, HIDDEN)
    load(emb.weight, w["emb.w"])
    out["vocab embedding"] = (emb(ids), F.embedding(ids, w["emb.w"]))

    head = ParallelLMHead(VOCAB, HIDDEN)
    load(head.weight, w["emb.w"])
    out["lm head"] = (head.compute_logits(x), x @ w["emb.w"].T)
    return out


def _rank_main(rank: int, init_file: str, results) -> None:
    """One rank: join the gloo group, compute every layer, send back the max errors (or the error)."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
        try:
            errors = {
                name: (
                    tuple(got.shape),
                    tuple(want.shape),
                    (got - want).abs().max().item() if got.shape == want.shape else None,
                )
                for name, (got, want) in _layer_outputs(rank).items()
            }
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", errors))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", traceback.format_exc()))


def _run_ranks(tmp_path, timeout: float = 120.0) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(tmp_path / "rendezvous"), results), daemon=True)
        for r in range(WORLD)
    ]
    try:
        for p in procs:
            p.start()
        replies, failures = {}, []
        for _ in range(WORLD):  # every rank's reply: the one that raised first is the cause
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                failures.append(f"no reply within {timeout} s")
                break
            if status == "ok":
                replies[rank] = value
            else:
                failures.append(f"rank {rank} failed:\n{value}")
        assert not failures, "\n".join(failures)
        return replies
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def test_every_tp_layer_with_bias_matches_the_full_computation(tmp_path):
    replies = _run_ranks(tmp_path)
    for rank, errors in replies.items():
        assert len(errors) == 7, errors
        for name, (got_shape, want_shape, err) in errors.items():
            assert got_shape == want_shape, f"rank {rank}, {name}: output shape {got_shape}, expected {want_shape}"
            assert err <= TOL, f"rank {rank}, {name}: max |TP - full| = {err:.3g} > {TOL}"


def test_the_layer_check_is_sensitive_to_a_misplaced_bias():
    """Negative control (no processes): the biases are large enough that a row-parallel bias
    added on each of the 2 ranks before the all-reduce, or one dropped, is off by far more than
    TOL; and the ids looked up straddle the vocabulary's shard boundary."""
    import torch.nn.functional as F

    w = _full_tensors()
    right = F.linear(w["x_inter"], w["row.w"], w["row.b"])
    twice = F.linear(w["x_inter"], w["row.w"]) + WORLD * w["row.b"]
    dropped = F.linear(w["x_inter"], w["row.w"])
    assert (twice - right).abs().max() > 100 * TOL and (dropped - right).abs().max() > 100 * TOL
    per_rank = -(-VOCAB // WORLD)
    assert {per_rank - 1, per_rank} <= set(_boundary_ids().tolist()) and VOCAB % WORLD
