"""RMSNorm in a 16-bit model (the opt-in bfloat16 CPU engine) against transformers' own module.

The float32 paths are checked bitwise elsewhere; a 16-bit input takes the PyTorch fallback, whose
last step must be transformers' ``weight * normed.to(input_dtype)`` (rounded twice: the normalized
value to the input dtype, then the product), not one rounding of the float32 product.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.layernorm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rmsnorm_is_bitwise_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    width = 256
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(width, generator=g) * 0.7 + 1.0).to(dtype)
    ours, theirs = RMSNorm(width, 1e-5).to(dtype), LlamaRMSNorm(width, eps=1e-5).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x, r = (torch.randn(64, width, generator=g) * 3).to(dtype), torch.randn(64, width, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        normed, summed = ours(x, r)
        assert torch.equal(summed, x + r)
        assert torch.equal(normed, theirs(x + r))
        # control: the float32 product rounded once differs from transformers somewhere
        h = x.float()
        once = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))).to(dtype)
        assert not torch.equal(once, theirs(x))
