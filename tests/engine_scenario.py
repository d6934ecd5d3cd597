"""A fixed small-cache scenario on a real engine: staggered arrivals, prefix sharing, preemption.

``run_scenario(llm, requests)`` drives ``llm.llm_engine`` step by step, adding each request at
its arrival step, and returns the finished ``RequestOutput``s by request id. ``SCENARIO`` is a
workload on the zoo model ``llama-mha-hd64`` (block size 8, 14 KV blocks, 24-token budget, 4
sequences) that preempts several requests, recomputes some of them in chunks that start past
their prompt, and shares prefixes between requests that run together and apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.zoo import ZOO
from nanovllm import SamplingParams
from tests.conftest import prompts_for

MODEL = "llama-mha-hd64"
ENGINE_ARGS = {"block_size": 8, "num_kvcache_blocks": 14, "max_num_seqs": 4, "max_num_batched_tokens": 24}


@dataclass(frozen=True)
class Arrival:
    step: int  # added before this step runs (0: before the first)
    request_id: str
    prompt: list[int]
    max_tokens: int


def scenario() -> list[Arrival]:
    vocab = ZOO[MODEL].vocab_size
    base = prompts_for(vocab, (40, 23, 17, 33, 5, 60, 16, 31), seed=1)
    shared = base[0]
    prompts = [
        base[0],
        base[1],
        base[2],
        base[3],
        shared[:32] + base[4],
        shared[:20] + base[6],
        base[5],
        base[7],
        shared[:24] + base[4],
        base[1][:16] + base[2][:3],
    ]
    max_tokens = [24, 30, 18, 40, 12, 20, 28, 16, 10, 14]
    arrivals = [0, 0, 0, 0, 0, 3, 3, 9, 30, 31]
    return [Arrival(a, f"r{i}", p, m) for i, (a, p, m) in enumerate(zip(arrivals, prompts, max_tokens))]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_scenario(llm, requests: list[Arrival], max_steps: int = 10_000) -> dict:
    """Add each request at its step, step until everything finished; outputs by request id."""
    engine = llm.llm_engine
    pending = sorted(requests, key=lambda a: a.step)
    outputs = {}
    for step in range(max_steps):
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, {"prompt_token_ids": a.prompt}, greedy(a.max_tokens))
        if not pending and not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs[out.request_id] = out
    raise AssertionError(f"scenario unfinished after {max_steps} steps")
