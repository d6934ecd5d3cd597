"""QKV sharding when each KV head is replicated on several ranks, for every rank of larger worlds.

With fewer KV heads than ranks (``tp_size // num_kv_heads`` replicas each), a rank must hold the
KV head its query heads attend to: query head h reads KV head ``h // (heads / kv_heads)``
(transformers' ``repeat_kv``). The gloo test runs 2 ranks, where 1 KV head is the only replicated
case and every rank's answer is head 0; here the loader is asked rank by rank (``tp_rank`` and
``tp_size`` patched, no process group) for worlds of 2 to 8 with 1, 2 and 4 KV heads.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers import linear

HEAD_DIM, HIDDEN = 2, 8


@pytest.mark.parametrize(
    "heads,kv_heads,tp", [(4, 1, 2), (8, 1, 4), (8, 2, 4), (8, 2, 8), (16, 4, 8), (8, 4, 4), (8, 2, 2)]
)
def test_each_rank_holds_the_kv_head_of_its_query_heads(monkeypatch, heads, kv_heads, tp):
    # every checkpoint row holds its own index, so a loaded row names where it came from
    q = torch.arange(heads * HEAD_DIM, dtype=torch.float32)[:, None].expand(-1, HIDDEN).contiguous()
    k = torch.arange(kv_heads * HEAD_DIM, dtype=torch.float32)[:, None].expand(-1, HIDDEN).contiguous() + 1000
    v = k + 1000
    group = heads // kv_heads
    monkeypatch.setattr(linear, "tp_size", lambda: tp)
    for rank in range(tp):
        monkeypatch.setattr(linear, "tp_rank", lambda rank=rank: rank)
        layer = linear.QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads)
        for shard, tensor in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, tensor, "w", shard)
        rows = layer.weight[:, 0].long().tolist()
        per_rank = heads // tp
        my_heads = range(rank * per_rank, (rank + 1) * per_rank)
        kv_of_mine = sorted({h // group for h in my_heads})
        want_q = [h * HEAD_DIM + i for h in my_heads for i in range(HEAD_DIM)]
        want_k = [1000 + g * HEAD_DIM + i for g in kv_of_mine for i in range(HEAD_DIM)]
        want_v = [2000 + g * HEAD_DIM + i for g in kv_of_mine for i in range(HEAD_DIM)]
        assert rows == want_q + want_k + want_v, f"rank {rank} of {tp}"
