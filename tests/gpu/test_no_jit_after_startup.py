"""No Triton kernel compiles after an engine has started: start-up compiles every variant the
engine can launch, so a fresh process's first request is as fast as its later ones.

Triton compiles one variant per specialisation of a kernel's arguments (integers equal to 1 or
divisible by 16, pointers aligned to 16 bytes). A batch whose lengths or staging offsets fall in
a class start-up did not meet compiles mid-run (the GPU benchmark's first run lost ~35 % to four
such compiles). The workload varies what varies in service: batch sizes odd and even, prompt
lengths around multiples of 16, chunked prefill beside decode, greedy and seeded rows.

It runs in a fresh process (kernels compiled by earlier tests of this worker would hide a
compile); a kernel launched with a new vocabulary size afterwards must be seen compiling
(negative control: the hook does see compiles). tests/test_kernel_specialisation.py checks the
decorators on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conformance.zoo import zoo_model
from tests.conftest import engine_args

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton")

SCRIPT = """
import json, sys, torch, triton
from nanovllm import LLM, SamplingParams
from nanovllm.layers import fused_sampler as fs

compiled = []
def hook(*_a, **kw):
    fn = kw.get("fn")
    compiled.append(f"{getattr(getattr(fn, 'fn', fn), '__name__', fn)} {str(kw.get('key', ''))[:200]}")
    return False  # compile as usual

model, args = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model, **args)
triton.knobs.runtime.jit_cache_hook = hook
lengths = [1, 2, 15, 16, 17, 31, 33, 47, 64, 65, 130, 200, 7, 9, 3]
for batch in (lengths, lengths[:5], lengths[2:9], lengths[:1]):
    prompts = [[(7 * i + j) % 500 + 10 for j in range(n)] for i, n in enumerate(batch)]
    params = [SamplingParams(max_tokens=3 + i % 5, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(len(batch))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
llm.close()
after_engine = list(compiled)
# negative control: a vocabulary size the engine never used is a new variant, and the hook sees it
n = 3
fs.sample(torch.zeros(n, 333, device="cuda"), torch.ones(n, device="cuda"), torch.zeros(n, dtype=torch.int64, device="cuda"))
torch.cuda.synchronize()
print(json.dumps({"after_engine": after_engine, "control": compiled[len(after_engine):]}))
"""


def test_no_kernel_compiles_after_startup():
    args = engine_args("cuda", dtype="bfloat16", max_num_batched_tokens=96)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), zoo_model("qwen3-gqa2-hd64-tied"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["control"], "the compile hook saw no compile for a new vocabulary size: it sees nothing"
    assert result["after_engine"] == [], f"{len(result['after_engine'])} Triton compiles after start-up:\n" + "\n".join(
        result["after_engine"]
    )
