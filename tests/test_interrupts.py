"""Ctrl-C during LLM.generate lands between engine steps: a SIGINT that arrives inside a step is
raised once the step has ended, and one that arrives while the caller holds an output is raised
there, as usual (nanovllm/engine/interrupts.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import nanovllm.llm as llm_module
from conformance.zoo import zoo_model
from nanovllm import SamplingParams
from nanovllm.engine.interrupts import DeferredInterrupts
from tests.conftest import cached_llm, prompts_for

MODEL = "qwen3-gqa4-hd128"
VOCAB = 1024
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _interrupted_mid_step(monkeypatch) -> tuple[list[str], object]:
    """generate() whose third step gets a real SIGINT half-way (before the real step runs);
    what the step reached, and the engine."""
    llm = cached_llm(zoo_model(MODEL), block_size=16, seed=0, enable_prefix_caching=False)
    engine = llm.llm_engine
    real_step, reached = engine.step, []

    def step():
        reached.append("start")
        if reached.count("start") == 3:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # bytecodes, where Python runs a pending signal handler
                pass
        out = real_step()
        reached.append("end")
        return out

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts_for(VOCAB, (20, 30), seed=6), GREEDY, use_tqdm=False)
    monkeypatch.setattr(engine, "step", real_step)
    return reached, llm


def test_a_sigint_inside_a_step_is_raised_after_the_step(monkeypatch):
    reached, llm = _interrupted_mid_step(monkeypatch)
    assert reached[-1] == "end" and reached.count("start") == 3, reached  # the step was not cut
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # the engine goes on, with the same greedy tokens as before
    p = prompts_for(VOCAB, (17,), seed=7)[0]
    first = llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(first) == 12 and llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back


class _NoGuard(DeferredInterrupts):
    def __enter__(self):
        return self


def test_negative_control_without_the_guard_the_sigint_cuts_the_step(monkeypatch):
    """The check above fails without the guard: the KeyboardInterrupt comes from inside the step."""
    monkeypatch.setattr(llm_module, "DeferredInterrupts", _NoGuard)
    reached, _ = _interrupted_mid_step(monkeypatch)
    assert reached[-1] == "start", reached


def test_a_callers_own_handler_and_other_threads_are_left_alone():
    mine = []
    previous = signal.signal(signal.SIGINT, lambda s, f: mine.append(s))
    try:
        guard = DeferredInterrupts()
        with guard:
            assert signal.getsignal(signal.SIGINT) is not guard._hold
        assert signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, guard._hold)
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = []

    def in_thread():
        with DeferredInterrupts() as g:
            seen.append(g._active)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen == [False]


def test_the_held_interrupt_is_raised_once():
    guard = DeferredInterrupts()
    with guard:
        assert guard._active
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):
            pass
    with pytest.raises(KeyboardInterrupt):
        guard.raise_pending()
    guard.raise_pending()  # nothing held any more


def _sigint_then_spin() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):  # bytecodes, where Python runs a pending signal handler
        pass


def test_a_second_sigint_after_the_first_has_waited_raises_at_once(monkeypatch):
    """A step that does not end (a hung tensor-parallel rank) must not make Ctrl-C useless: a second
    SIGINT once the first has been held for ESCALATE_AFTER_S raises where it lands."""
    monkeypatch.setattr(DeferredInterrupts, "ESCALATE_AFTER_S", 0.05)
    guard = DeferredInterrupts()
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with guard:
            _sigint_then_spin()
            reached.append("held the first")
            time.sleep(0.1)
            _sigint_then_spin()
            reached.append("ran past the second")
    assert reached == ["held the first"]
    assert not guard.pending and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_quick_double_ctrl_c_is_held_like_one():
    """A double tap inside a step that is ending is held: cut at any bytecode, a step can leave the
    scheduler half updated. Control of the test above: the same two SIGINTs, close together."""
    guard = DeferredInterrupts()
    reached = []
    with guard:
        _sigint_then_spin()
        _sigint_then_spin()
        reached.append("ran whole")
    assert reached == ["ran whole"] and guard.pending
    with pytest.raises(KeyboardInterrupt):
        guard.raise_pending()


def test_a_sigint_while_the_caller_holds_an_output_is_raised_in_the_callers_code():
    """Between outputs the caller's code runs under Python's own handler: a Ctrl-C there raises
    at once, in that code; the iterator, closed, aborts what is left and the engine is clean."""
    llm = cached_llm(zoo_model(MODEL), block_size=16, seed=0, enable_prefix_caching=False)
    it = llm.generate_iter(
        prompts_for(VOCAB, (5, 30), seed=4),
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 12)],
        use_tqdm=False,
    )
    next(it)  # the short request is done; the long one is not
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    reached = []
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):
            pass
        reached.append("after")  # not reached: the interrupt lands in this loop
    assert not reached
    it.close()
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.check_invariants()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_interrupts_run_the_block_whole_then_raise():
    from nanovllm.engine.interrupts import deferred_interrupts

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):
                pass
            reached.append("end")
    assert reached == ["end"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
