"""The worker's per-sequence state is released on every way a request can end.

The engine names each sequence that left it (finished, aborted while running or waiting, a child
of an aborted n > 1 request) in the next step's ``ModelInput.finished_seq_ids``; the CPU model
runner then drops that sequence's seeded ``torch.Generator``. A path that forgets to name its
sequence leaks the generator for the process's life: an abort that did so passed every test
that only checked the scheduler's blocks and queues (hunt 3, B6). The fake-executor state
machine checks the same rule on random workloads (``check_worker_state_released`` in
tests/properties/test_scheduler_properties.py); this file checks it on the real runner.
"""

from __future__ import annotations

from conformance.zoo import zoo_model
from nanovllm import LLM, SamplingParams

MODEL = "llama-1kv-hd128"


def _seeded(seed: int, max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, n=n, ignore_eos=True)


def test_every_exit_path_releases_the_workers_per_sequence_state():
    """Seeded requests that finish, that are aborted while running, one aborted while waiting,
    and an n = 2 request aborted as a whole; then one unseeded request run to completion (its
    first step names every earlier sequence). Every sequence the worker was sent must have been
    named in ``finished_seq_ids``, and the CPU runner must hold no generator. Control: while
    the seeded requests run, the runner does hold one generator each (the check is not vacuous)."""
    llm = LLM(zoo_model(MODEL), device="cpu", max_model_len=128, max_num_seqs=4, seed=0)
    try:
        engine = llm.llm_engine
        runner = engine.executor.runner
        seen: set[int] = set()  # every seq_id a step computed
        named: set[int] = set()  # every seq_id a step named as finished

        def recording(method):
            def call(mi):
                seen.update(mi.seq_ids)
                named.update(mi.finished_seq_ids)
                return method(mi)

            return call

        engine.executor.execute = recording(engine.executor.execute)
        engine.executor.launch = recording(engine.executor.launch)

        engine.add_request("finishes", [5, 6, 7], _seeded(1, 3))
        engine.add_request("aborted-running", [5, 6, 7, 8], _seeded(2, 50))
        engine.add_request("parent", [9, 10, 11], _seeded(3, 50, n=2))  # two children
        engine.add_request("aborted-waiting", [12, 13], _seeded(4, 50))  # 5th sequence: max_num_seqs=4
        for _ in range(2):
            engine.step()
        assert {s.request_id for s in engine.scheduler.waiting} == {"aborted-waiting"}
        assert len(runner.generators) == 4, "control: each running seeded sequence holds a generator"
        engine.abort_request("aborted-running")
        engine.abort_request("parent")
        engine.abort_request("aborted-waiting")
        while engine.has_unfinished_requests():  # "finishes" runs to its end
            engine.step()
        before_last = set(seen)
        [out] = llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert out.finished

        assert runner.generators == {}, f"generators left on the worker for seq_ids {sorted(runner.generators)}"
        assert before_last - named == set(), f"seq_ids never named as finished: {sorted(before_last - named)}"
    finally:
        llm.close()
