"""The executor interface: what the engine loop asks of the device side.

``LocalExecutor`` (one process, ``nanovllm.worker.local_executor``) and
``TensorParallelExecutor`` (one worker process per rank, ``nanovllm.worker.distributed``)
implement it; tests drive the real engine loop over a fake one.
"""

from __future__ import annotations

from typing import Protocol

from nanovllm.core.model_input import ModelInput
from nanovllm.core.model_output import ModelOutput


class StepHandle(Protocol):
    def result(self) -> ModelOutput: ...


class Executor(Protocol):
    def profile_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget."""

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def execute(self, mi: ModelInput) -> ModelOutput:
        """Run one step and wait for its output."""

    def launch(self, mi: ModelInput) -> StepHandle:
        """Queue one step and return at once (async scheduling): the sampled tokens stay on the
        device, where the next step's placeholder rows read them."""

    def close(self) -> None: ...


def make_executor(config, load_format: str = "auto") -> Executor:
    """The executor for a resolved EngineConfig (imports torch)."""
    if config.tensor_parallel_size > 1:
        from nanovllm.worker.distributed import TensorParallelExecutor

        return TensorParallelExecutor(config, load_format)
    from nanovllm.worker.local_executor import LocalExecutor

    return LocalExecutor(config, load_format)
