"""The engine core in its own process (``AsyncLLM.from_engine_args(..., engine_process=True)``):
its outputs equal the in-process engine's for every kind of request, a dead core fails every
caller at once, a bad argument is the caller's error, and no core outlives its front end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError
from nanovllm.sampling_params import RequestOutputKind
from tests.conftest import prompts_for
from tests.test_async_llm import ENGINE_ARGS, MODEL, blocks_and_requests

DELTA, CUMULATIVE, FINAL = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def _requests():
    """Requests that exercise every field an output carries: logprobs and prompt logprobs, stop
    strings (text cut by the core), stop token ids, n > 1 with seeds, min_tokens, each kind."""
    vocab = ZOO[MODEL].vocab_size
    prompts = prompts_for(vocab, (7, 19, 4, 33, 11, 9), seed=11)
    base = dict(max_tokens=16, ignore_eos=True)
    return [
        (prompts[0], SamplingParams(temperature=0, logprobs=3, prompt_logprobs=2, **base)),
        (prompts[1], SamplingParams(temperature=0.8, seed=7, n=3, logprobs=1, **base)),
        (prompts[2], SamplingParams(temperature=0, stop_token_ids=[prompts[2][0]], min_tokens=2, **base)),
        (prompts[3], SamplingParams(temperature=1.0, seed=3, top_k=20, top_p=0.9, **base)),
        (prompts[4], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)),
        (prompts[5], SamplingParams(temperature=0.7, seed=5, n=2, prompt_logprobs=1, **base)),
        ("a text prompt, tokenized by the front end", SamplingParams(temperature=0, prompt_logprobs=1, **base)),
    ]


def _stop_string_request(engine_text: str, prompt):
    """A request whose stop string is a piece of the text it will produce (found by a first run)."""
    stop = engine_text[len(engine_text) // 2 : len(engine_text) // 2 + 3]
    return prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])


def _lps(lps):
    if lps is None:
        return None
    return [
        None if d is None else sorted((t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()) for d in lps
    ]


async def _run_all(engine: AsyncLLM, requests, kind: RequestOutputKind):
    async def one(i, prompt, params):
        return [out async for out in engine.generate(prompt, _with_kind(params, kind), f"q{i}")]

    return await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(requests)))


def _final(pieces, kind):
    """The request's whole result from its outputs (DELTA pieces added up per completion)."""
    if kind is not DELTA:
        last = {}
        for out in pieces:  # n > 1 streams each child's latest output
            for c in out.outputs:
                last[c.index] = c
        return pieces[-1], last
    acc = {}
    for out in pieces:
        for c in out.outputs:
            prev = acc.get(c.index)
            acc[c.index] = c if prev is None else _concat(prev, c)
    return pieces[-1], acc


def _concat(a, b):
    import dataclasses

    return dataclasses.replace(
        b,
        text=a.text + b.text,
        token_ids=list(a.token_ids) + list(b.token_ids),
        logprobs=None if b.logprobs is None else list(a.logprobs or []) + list(b.logprobs),
    )


def _collect(make_engine, kind):
    engine = make_engine()
    try:

        async def main():
            first = await _run_all(engine, _requests(), kind)
            # a stop-string request, from this engine's own greedy text
            text = _final(first[0], kind)[1][0].text
            stop_req = _stop_string_request(text, _requests()[0][0])
            stopped = [out async for out in engine.generate(stop_req[0], _with_kind(stop_req[1], kind), "stop")]
            return first + [stopped], await engine.call(blocks_and_requests)

        results, (free, total, live) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert free == total and live == [], "a finished request kept blocks or stayed in the engine"
    finals = []
    for pieces in results:
        last, completions = _final(pieces, kind)
        assert last.finished and not any(p.finished for p in pieces[:-1])
        finals.append(
            (
                last.request_id,
                last.prompt,
                last.prompt_token_ids,
                _lps(pieces[0].prompt_logprobs),
                [
                    (i, c.text, list(c.token_ids), _lps(c.logprobs), c.finish_reason, c.stop_reason)
                    for i, c in sorted(completions.items())
                ],
            )
        )
    return finals


# Logprobs are float sums whose order depends on the batch a step happened to hold and on the
# thread count (the core in its own process leaves a core to the front end), so the two engines'
# logprobs agree to float noise (~1e-5 seen in CI), not bit for bit. Everything else is exact.
LOGPROB_ATOL = 1e-4


def assert_same(got, expected, path="outputs"):
    """``got == expected`` with floats compared to ``LOGPROB_ATOL``; names where they differ."""
    if isinstance(expected, float) and isinstance(got, float):
        assert abs(got - expected) <= LOGPROB_ATOL, f"{path}: {got} != {expected} (atol {LOGPROB_ATOL})"
    elif isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), f"{path}: {got!r} != {expected!r}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}[{i}]")
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def test_the_comparison_fails_on_a_changed_token_text_or_logprob():
    """Negative control of ``assert_same``: float noise passes; a logprob off by more than the
    tolerance, a changed token, text or finish reason, or a missing completion fails."""
    row = ("q0", None, [1, 2], [None, [(5, -1.25, 1, "w5")]], [(0, "w5", [5], [[(5, -0.5, 1, "w5")]], "length", None)])
    assert_same(row, row)
    noisy = (
        "q0",
        None,
        [1, 2],
        [None, [(5, -1.25002, 1, "w5")]],
        [(0, "w5", [5], [[(5, -0.49999, 1, "w5")]], "length", None)],
    )
    assert_same(noisy, row)
    bad = [
        ("q0", None, [1, 2], [None, [(5, -1.2505, 1, "w5")]], row[4]),
        ("q0", None, [1, 2], row[3], [(0, "w5", [6], [[(5, -0.5, 1, "w5")]], "length", None)]),
        ("q0", None, [1, 2], row[3], [(0, "w6", [5], [[(5, -0.5, 1, "w5")]], "length", None)]),
        ("q0", None, [1, 2], row[3], [(0, "w5", [5], [[(5, -0.5, 1, "w5")]], "stop", None)]),
        ("q0", None, [1, 2], row[3], []),
        ("q0", None, [1, 2], [None, [(5, -1.25, 2, "w5")]], row[4]),
    ]
    for b in bad:
        with pytest.raises(AssertionError):
            assert_same(b, row)


def _with_kind(params, kind):
    import dataclasses

    return dataclasses.replace(params, output_kind=kind)


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL], ids=lambda k: k.name)
def test_process_outputs_equal_thread_outputs(kind):
    """Same requests (logprobs, prompt logprobs, stop strings and ids, n > 1, seeds) through the
    engine on a thread and in its own process: every output's text, ids, logprobs and finish
    fields agree. The stop string's text is cut by the core and sent with its last update."""

    def thread_engine():
        return AsyncLLM(LLM(zoo_model(MODEL), **ENGINE_ARGS).llm_engine)

    def process_engine():
        return AsyncLLM.from_engine_args(zoo_model(MODEL), engine_process=True, **ENGINE_ARGS)

    expected = _collect(thread_engine, kind)
    got = _collect(process_engine, kind)
    assert_same(got, expected)
    stop_row = expected[-1][4][0]
    assert stop_row[4] == "stop" and isinstance(stop_row[5], str), "the stop-string request did not stop on it"
    assert any(len(row[4]) > 1 for row in expected), "no n > 1 request in the comparison"
    assert any(isinstance(row[1], str) for row in expected), "no text prompt in the comparison"


def test_a_killed_core_fails_every_caller_and_later_calls():
    engine = AsyncLLM.from_engine_args(zoo_model(MODEL), engine_process=True, **ENGINE_ARGS)
    pid = engine.client.process.pid
    try:

        async def main():
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=DELTA)
            got, errors = [], []

            async def consume(rid):
                try:
                    async for out in engine.generate([5, 6, 7], long, rid):
                        got.append(out)
                except EngineDeadError as e:
                    errors.append(str(e))

            tasks = [asyncio.create_task(consume(f"k{i}")) for i in range(3)]
            while len(got) < 3:
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            later = None
            try:
                async for _ in engine.generate([5], long, "later"):
                    pass
            except EngineDeadError as e:
                later = str(e)
            return errors, later

        errors, later = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(errors) == 3, errors
    assert later is not None and not engine.is_running


def test_a_bad_engine_argument_is_the_callers_error_and_leaves_no_process():
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="block_size"):
        AsyncLLM.from_engine_args(zoo_model(MODEL), engine_process=True, block_size=0, max_model_len=256)
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_the_core_leaves_when_its_front_end_is_killed(tmp_path):
    """A front end killed with SIGKILL (no shutdown, no atexit) leaves no engine core behind."""
    script = tmp_path / "front.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from nanovllm.engine.async_llm import AsyncLLM
            if __name__ == "__main__":
                e = AsyncLLM.from_engine_args({zoo_model(MODEL)!r}, engine_process=True, max_model_len=256)
                print(e.client.process.pid, flush=True)
                time.sleep(600)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        core_pid = int(front.stdout.readline())  # type: ignore[union-attr]
        assert _alive(core_pid)
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 15
        while _alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(core_pid), f"the engine core (pid {core_pid}) outlived its front end"
    finally:
        front.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("cores, expected", [(8, 7), (4, 3), (3, None), (2, None), (1, None)])
def test_the_core_leaves_a_cpu_core_to_the_front_end(monkeypatch, cores, expected):
    """Unless the thread count was chosen, the core's torch threads leave one core for the front
    end where there are four or more (on fewer, the engine's own default stands); a chosen count
    is kept."""
    import nanovllm.engine.core_process as core_process

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(core_process, "default_threads", lambda: cores)
    want = {"seed": 0} if expected is None else {"seed": 0, "threads": expected}
    assert core_process.with_front_end_core({"seed": 0}) == want
    assert core_process.with_front_end_core({"threads": cores}) == {"threads": cores}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert core_process.with_front_end_core({"seed": 0}) == {"seed": 0}


@pytest.mark.parametrize("cores, front_ends, expected", [(16, 4, 12), (8, 2, 6), (4, 4, 1), (4, 8, 1), (3, 2, None)])
def test_the_core_leaves_a_cpu_core_to_each_front_end(monkeypatch, cores, front_ends, expected):
    """With several front-end processes (``serve --api-server-count``) each gets a core, the model
    keeping at least one thread."""
    import nanovllm.engine.core_process as core_process

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(core_process, "default_threads", lambda: cores)
    want = {"seed": 0} if expected is None else {"seed": 0, "threads": expected}
    assert core_process.with_front_end_core({"seed": 0}, front_ends=front_ends) == want


def test_an_update_brings_the_mirror_to_the_core_sequence():
    """make_update's plain tuple has SequenceUpdate's field order, and applying the updates of
    successive reports to a mirror (a copy taken when the request was accepted) gives the core
    sequence's tokens, logprobs, prompt logprobs, finish fields and times."""
    import copy

    from nanovllm.core.sequence import Sequence
    from nanovllm.engine.core_output import CoreStream, SequenceUpdate, apply_update, make_update

    params = SamplingParams(max_tokens=8, logprobs=1, prompt_logprobs=1, stop=["xy"])
    core = Sequence(0, "r", [1, 2, 3], params)
    mirror = copy.deepcopy(core)
    state = CoreStream()
    core.prompt_logprobs += [(2, (-0.5, 1, [(2, -0.5)])), (3, (-0.7, 2, [(9, -0.1)]))]
    for step, token in enumerate([7, 8, 9]):
        core.token_ids.append(token)
        core.output_logprobs.append((token, (-0.1 * step, 1, [(token, -0.1 * step)])))
        core.cumulative_logprob -= 0.1 * step
        core.metrics.last_token_time = 100.0 + step
        if token == 9:
            core.finish_reason, core.stop_reason, core.output_text = "stop", "xy", "ab"
        update = make_update(core, state)
        assert SequenceUpdate(*update).new_token_ids == [token]
        apply_update(mirror, update)
    assert mirror.token_ids == core.token_ids and mirror.output_logprobs == core.output_logprobs
    assert mirror.prompt_logprobs == core.prompt_logprobs and mirror.cumulative_logprob == core.cumulative_logprob
    assert (mirror.finish_reason, mirror.stop_reason, mirror.output_text) == ("stop", "xy", "ab")
    assert mirror.metrics.last_token_time == 102.0
    with pytest.raises(ValueError, match="applied to"):
        apply_update(Sequence(1, "other", [1], params), update)


def test_a_request_id_is_usable_again_after_its_caller_left_with_news_unread():
    """A streaming caller that leaves while an output waits unread in its queue, then a new
    request with the same id: the new caller gets its outputs (the 'news waiting' mark belongs
    to the old request, not to the id)."""
    engine = AsyncLLM.from_engine_args(zoo_model(MODEL), engine_process=True, **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=DELTA)
    try:

        async def main():
            gen = engine.generate([5, 6, 7], params, "same")
            await anext(gen)
            seen = engine.stats["steps"]
            while engine.stats["steps"] < seen + 3:  # more news queues up, unread
                await asyncio.sleep(0.005)
            await gen.aclose()
            short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, output_kind=DELTA)

            async def again():
                return [out async for out in engine.generate([5, 6], short, "same")]

            outs = await asyncio.wait_for(again(), timeout=30)
            return outs, await engine.call(blocks_and_requests)

        outs, (free, total, live) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 5
    assert free == total and live == []


def test_an_n_request_is_accepted_whole_or_not_at_all():
    """The core validates every child of an n > 1 request before it queues any: when child 1's
    id is taken, child 0 must not be left running either."""
    engine = AsyncLLM.from_engine_args(zoo_model(MODEL), engine_process=True, **ENGINE_ARGS)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=DELTA)
    try:

        async def main():
            holder = engine.generate([5, 6, 7], long, "1_x")  # the id child 1 of "x" would get
            await anext(holder)
            error = None
            try:
                await anext(engine.generate([8, 9], SamplingParams(n=2, max_tokens=4, seed=1), "x"))
            except ValueError as e:
                error = str(e)
            live = (await engine.call(blocks_and_requests))[2]
            await holder.aclose()
            return error, live

        error, live = asyncio.run(main())
    finally:
        engine.shutdown()
    assert error is not None and "1_x" in error, error
    assert live == ["1_x"], f"a refused n = 2 request left {live}"


def test_the_front_end_tokenizes_text_prompts_for_the_core():
    """A text prompt reaches the core with its token ids (the core's step loop does no tokenizer
    work); token ids and prompts the core must refuse (empty text) go as they are."""
    from transformers import AutoTokenizer

    from nanovllm.engine.async_llm_process import ProcessAsyncLLM

    sent = []
    front = ProcessAsyncLLM.__new__(ProcessAsyncLLM)
    front.client = SimpleNamespace(send=sent.append)
    front.tokenizer = AutoTokenizer.from_pretrained(zoo_model(MODEL))
    front._pending, front._tokens = {}, iter(range(100))
    params = SamplingParams(max_tokens=2)
    for prompt in ("hello there", {"prompt": "hello there"}, [5, 6], "", {"prompt_token_ids": [7]}):
        front._submit_add("r", prompt, params, added=None)
    got = [msg[2][0][1] for msg in sent]
    ids = front.tokenizer.encode("hello there")
    assert got[0] == got[1] == {"prompt": "hello there", "prompt_token_ids": ids}
    assert got[2:] == [[5, 6], "", {"prompt_token_ids": [7]}]


def test_core_timing_reports_the_longest_busy_period(monkeypatch):
    """The core's exit log: steps, sending, idle, and its longest busy period (from the request
    that woke it to when nothing was left), with the delay before that period's first step and
    the period's start and end in Unix time."""
    from nanovllm.engine import core_process

    now = [100.0]
    monkeypatch.setattr(core_process.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(core_process.time, "time", lambda: now[0] + 1.7e9)  # Unix time, another origin
    timing = core_process.CoreTiming()
    for steps, step_s in ((2, 0.5), (5, 0.25)):  # two busy periods: 1.2 s and 1.35 s long
        now[0] += 3.0  # idle
        timing.woke(now[0] - 3.0)
        now[0] += 0.1  # the first step starts 100 ms after the request came
        for _ in range(steps):
            timing.add_step(now[0], step_s, 0.0)
            now[0] += step_s
        timing.end_period()
    text = timing.summary()
    assert "7 steps in 2.25 s" in text and "6.0 s idle" in text, text
    assert "longest busy period 1.35 s: 5 steps taking 1.25 s, the first 100.0 ms after" in text, text
    assert "busy from 1700000107.100 to 1700000108.450 (Unix time)" in text, text


def _echo_after(seconds: float, payload: bytes, e) -> bytes:
    """Run in the core: hold the step loop (the core reads no command meanwhile), then answer."""
    time.sleep(seconds)
    return payload


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_messages_larger_than_the_pipe_cross_both_ways(loop_kind):
    """A command and an answer each far larger than the pipe's buffer (8 MiB; a socketpair holds
    ~200 KiB) cross whole, on asyncio's loop and on uvloop, while the core is busy. uvloop's
    ``add_reader`` switches a pipe to non-blocking: reading the core's messages on the loop then
    failed mid-message, and the sender thread's write to the full pipe failed with EAGAIN and
    ended the thread, so every later command was lost (a served benchmark hung with 153 of 256
    requests never reaching the core)."""
    import functools
    import os

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed (pip install uvloop)")
        run = uvloop.run
    else:
        run = asyncio.run
    big = os.urandom(8 << 20)
    engine = AsyncLLM.from_engine_args(zoo_model(MODEL), engine_process=True, **ENGINE_ARGS)
    try:

        async def main():
            busy = asyncio.ensure_future(engine.call(functools.partial(_echo_after, 1.0, b"")))
            await asyncio.sleep(0.2)  # the core is in the first call: the big one fills the pipe
            answer = await asyncio.wait_for(engine.call(functools.partial(_echo_after, 0.0, big)), 60)
            await busy
            outs = [out async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "after")]
            return answer, outs[-1], os.get_blocking(engine.client.conn.fileno())

        answer, last, blocking = run(main())
    finally:
        engine.shutdown()
    assert answer == big, "the answer did not come back whole"
    assert last.finished and len(last.outputs[0].token_ids) == 4, "the engine stopped serving after the big messages"
    assert blocking, "the event loop switched the engine pipe to non-blocking"


def test_an_n_request_cancelled_before_the_core_answers_its_add_leaves_nothing_running():
    """Cancelling an n > 1 request at once (its "add" not answered yet) aborts all its children:
    the core knows them by their own ids, never the parent's."""

    async def main():
        engine = AsyncLLM.from_engine_args(zoo_model(MODEL), engine_process=True, **ENGINE_ARGS)
        try:
            params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=200, ignore_eos=True)
            gen = engine.generate([5, 6, 7, 8], params, "nreq")
            task = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)  # the add is sent; its answer has not come back
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gen.aclose()
            deadline = time.monotonic() + 10
            while True:
                free, total, live = await engine.call(blocks_and_requests)
                if not live or time.monotonic() > deadline:
                    assert engine._adding == {}, f"adds still pending after the core answered: {engine._adding}"
                    return free, total, live, (await engine.call(_steps))
                await asyncio.sleep(0.05)
        finally:
            engine.shutdown()

    free, total, live, steps = asyncio.run(main())
    assert live == [] and free == total, (free, total, live)
    assert steps < 100, f"{steps} steps: the children ran on after their request was cancelled"


def _steps(engine) -> int:
    return engine.stats()["steps"]
