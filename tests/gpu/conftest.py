"""Kernel tests under Triton's CPU interpreter (``NANOVLLM_TRITON_INTERPRET=1``, run by
test_triton_interpret.py): Triton 3.6's interpreter calls int() on 1-element arrays (loop
bounds from loaded scalars, program ids and scalar arguments), which numpy >= 2.4 refuses;
every kernel test file gets the element explicitly."""

from __future__ import annotations

import os

if os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") == "1":
    import triton.runtime.interpreter as _interp

    _patch_tensor = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor
