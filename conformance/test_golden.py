"""The golden files: well formed, small, made from the models available here, and (slow)
reproducible: regenerating them gives identical tokens and logprobs to 1e-5."""

from __future__ import annotations

import json

import pytest

import golden

MAX_TOTAL_BYTES = 600_000


def test_golden_files_present_and_current():
    total = 0
    for name in golden.NAMES:
        g = golden.load(name)
        total += golden.path_of(name).stat().st_size
        assert g["dtype"] == "float32" and g["reference"]["name"] == "transformers"
        golden.require(g)
        lengths = {len(c["prompt"]) for c in g["cases"]}
        bs = g["block_size"]
        assert {1, bs - 1, bs, bs + 1, 2 * bs, 5 * bs + 3} <= lengths, sorted(lengths)
        for c in g["cases"]:
            assert len(c["greedy"]) == g["max_tokens"] == len(c["top_ids"]) == len(c["top_lps"])
            assert len(c["prompt_lps"]) == len(c["prompt"]) - 1
            assert all(tok == ids[0] for tok, ids in zip(c["greedy"], c["top_ids"])), c["id"]
    assert total <= MAX_TOTAL_BYTES, f"golden files total {total} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("name", golden.NAMES)
def test_golden_files_reproducible(name, tmp_path):
    from golden.make import main

    assert main(["--only", name, "--out", str(tmp_path)]) == 0
    new = json.loads(golden.path_of(name, tmp_path).read_text())
    old = golden.load(name)
    assert new["model"] == old["model"]
    assert [c["prompt"] for c in new["cases"]] == [c["prompt"] for c in old["cases"]]
    for a, b in zip(new["cases"], old["cases"]):
        assert a["greedy"] == b["greedy"] and a["top_ids"] == b["top_ids"], f"case {a['id']}: tokens differ"
        for key in ("top_lps", "prompt_lps"):
            fa = [x for row in a[key] for x in (row if isinstance(row, list) else [row])]
            fb = [x for row in b[key] for x in (row if isinstance(row, list) else [row])]
            assert max((abs(x - y) for x, y in zip(fa, fb)), default=0.0) <= 1e-5, f"case {a['id']}: {key}"
    if "sampling" in old:
        assert new["sampling"]["prompt"] == old["sampling"]["prompt"]
        assert max(abs(x - y) for x, y in zip(new["sampling"]["logprobs"], old["sampling"]["logprobs"])) <= 1e-5
