"""Parallel sampling (``SamplingParams.n > 1``), as vLLM does it: a request fans out into n child
requests, whose completions come back as the parent request's outputs.

Child i is an ordinary request with id ``f"{i}_{request_id}"`` and the parent's sampling
params with ``n = 1`` and, when the parent has a seed, ``seed + i`` (so each completion is
reproducible on its own and the n completions draw independent noise). The children share
the prompt, so the prefix cache computes it once when enabled. What the parent reports follows
its ``output_kind``: FINAL_ONLY (``LLM.generate``) one RequestOutput with the n completions
(``index`` 0..n-1) once every child has finished; CUMULATIVE / DELTA each child's report as it
comes, as the parent's RequestOutput holding that one completion (its ``index`` says which),
``finished`` once every child has. The engine holds a ParentRequest until then.
"""

from __future__ import annotations

import dataclasses

from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams, child_seed


def _merge_metrics(metrics: list[RequestMetrics | None]) -> RequestMetrics | None:
    """The parent's timestamps: earliest arrival, scheduling and first token; latest last token
    and finish (None while a child has none); token and preemption counts summed."""
    ms = [m for m in metrics if m is not None]
    if not ms:
        return None

    def first(name):
        values = [getattr(m, name) for m in ms if getattr(m, name) is not None]
        return min(values) if values else None

    def last(name):
        values = [getattr(m, name) for m in ms]
        return None if any(v is None for v in values) else max(values)

    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms),
        first_scheduled_time=first("first_scheduled_time"),
        first_token_time=first("first_token_time"),
        last_token_time=last("last_token_time"),
        finished_time=last("finished_time"),
        num_generation_tokens=sum(m.num_generation_tokens for m in ms),
        num_preemptions=sum(m.num_preemptions for m in ms),
    )


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams):
        if params.n < 2:
            raise ValueError(f"a ParentRequest needs n >= 2, got n={params.n}")
        self.request_id = request_id
        self.params = params
        self.child_ids = [f"{i}_{request_id}" for i in range(params.n)]
        self._index = {cid: i for i, cid in enumerate(self.child_ids)}
        self._finished = [False] * params.n
        self._latest: list[tuple[RequestOutput, CompletionOutput] | None] = [None] * params.n

    def child_params(self, index: int) -> SamplingParams:
        return dataclasses.replace(self.params, n=1, seed=child_seed(self.params.seed, index))

    @property
    def num_unfinished(self) -> int:
        return self._finished.count(False)

    def add_child_output(self, out: RequestOutput) -> RequestOutput | None:
        """A child's report -> what the parent reports now (None: nothing yet)."""
        i = self._index[out.request_id]
        if self._finished[i]:
            raise RuntimeError(f"child {out.request_id!r} of {self.request_id!r} reported after it finished")
        self._finished[i] = out.finished
        self._latest[i] = (out, dataclasses.replace(out.outputs[0], index=i))
        if self.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return self._output(range(self.params.n)) if self.num_unfinished == 0 else None
        return self._output([i])

    def combine(self, outputs: list[RequestOutput]) -> RequestOutput:
        """Several of the parent's reports as one (an abort ends the children at once)."""
        if len(outputs) == 1:
            return outputs[0]
        completions = sorted((c for o in outputs for c in o.outputs), key=lambda c: c.index)
        return dataclasses.replace(
            outputs[-1],
            outputs=completions,
            finished=self.num_unfinished == 0,
            metrics=_merge_metrics([o.metrics for o in outputs]),
        )

    def _output(self, indices) -> RequestOutput:
        reports = [self._latest[i] for i in indices]
        first = reports[0][0]  # the prompt, its logprobs and its cache hits are every child's
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[c for _, c in reports],
            finished=self.num_unfinished == 0,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs,
            metrics=_merge_metrics([o.metrics for o, _ in reports]),
        )


def report_through_parent(out: RequestOutput, parent: ParentRequest | None, parents: dict) -> RequestOutput | None:
    """What a sequence's output makes its request report: the output itself, or for a child of
    an n > 1 request its parent's output (None: nothing yet). A parent whose children have all
    finished leaves ``parents`` (request id -> ParentRequest)."""
    if parent is None:
        return out
    reported = parent.add_child_output(out)
    if parent.num_unfinished == 0:
        del parents[parent.request_id]
    return reported
