"""What a step returns to the engine, as plain data (picklable: TP rank 0 sends it back).

``SamplerOutput`` holds one entry per sample row (the order of ``ModelInput.sample_rows``);
``ModelOutput`` adds the prompt logprobs of each prompt-logprob job of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

# one position's logprobs: (the target or sampled token's logprob, its rank, top-k [(token, logprob)])
LogprobEntry = tuple[float, int, list[tuple[int, float]]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    nonfinite_rows: list[int]  # rows whose logits held NaN/inf: their token is void
    logprobs: list[LogprobEntry | None]  # per row: None unless the request asked for logprobs


@dataclass
class ModelOutput:
    sampled: SamplerOutput | None  # None when no row samples (or on TP ranks > 0)
    prompt_logprobs: list[list[LogprobEntry]]  # per prompt-logprob job: one entry per target position


class ReadyOutput:
    """A step handle whose output is already known (synchronous execution)."""

    def __init__(self, output: ModelOutput):
        self._output = output

    def result(self) -> ModelOutput:
        return self._output
