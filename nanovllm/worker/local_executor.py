"""LocalExecutor: the model runner in this process (tensor_parallel_size == 1)."""

from __future__ import annotations

import gc

import torch

from nanovllm.config import EngineConfig
from nanovllm.core.model_input import ModelInput
from nanovllm.core.model_output import ModelOutput
from nanovllm.worker.model_runner import ModelRunner, StepHandle


class LocalExecutor:
    def __init__(self, config: EngineConfig, load_format: str = "auto"):
        self.runner = ModelRunner(config, load_format)

    def profile_num_blocks(self) -> int:
        return self.runner.profile_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, mi: ModelInput) -> ModelOutput:
        return self.runner.execute(mi)

    def launch(self, mi: ModelInput) -> StepHandle:
        return self.runner.launch(mi)

    def close(self) -> None:
        if self.runner.device.type == "cuda":
            # a step may still run on the device (async scheduling, or a step interrupted by
            # Ctrl-C after its launch): nothing it reads or writes is freed before it ends
            torch.cuda.synchronize(self.runner.device)
        self.runner.free_kv_cache()
        # the weights (on the CPU also their oneDNN-packed copies), workspaces and buffers go with
        # the runner (free_kv_cache dropped the graphs; ``release`` drops the weights' storage itself:
        # without that, every engine made and closed in one process kept ~0.9 GB (SmolLM2-135M,
        # float32) until the next full garbage collection)
        self.runner.release()
        if self.runner.device.type == "cuda":
            # and back to the device: other processes, or the next engine, can take it
            gc.collect()
            torch.cuda.empty_cache()
