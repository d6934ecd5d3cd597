"""The engine core with several front-end pipes (``serve --api-server-count``), driven in this
process over real pipes: each front end gets the updates of the requests it added and no
others; a front end whose pipe closes has its running requests aborted (every KV block comes
back) while the other's finish; each front end gets the stats when the core goes idle.

The routing check is shown to catch a core that sends every update to every front end."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import SamplingParams
from nanovllm.engine.core_process import EngineCore
from nanovllm.engine.engine import LLMEngine
from tests.conftest import prompts_for
from tests.test_async_llm import ENGINE_ARGS, MODEL, blocks_and_requests

SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


class BroadcastingCore(EngineCore):
    """Known-bad: every update goes to every front end."""

    def _send_updates(self, updates):
        if updates:
            for i in self.live - {0}:
                self.outboxes[i].send(("out", updates, self.engine.stats()))


def state_and_steps(engine) -> tuple:
    """(free blocks, blocks, live requests, steps so far): module-level, a "call" command."""
    return (*blocks_and_requests(engine), engine.stats()["steps"])


def _recv(conn, timeout: float = 60.0):
    assert conn.poll(timeout), "the core sent nothing"
    return conn.recv()


def _until(conn, kind: str, messages: list):
    while True:
        msg = _recv(conn)
        messages.append(msg)
        if msg[0] == kind:
            return msg


def run_scenario(core_cls) -> dict:
    """Front end A adds two short requests and a long one it aborts at once, B one long one; A
    reads until its requests finish, then B closes its pipe mid-request; A asks for the engine's state once the core is idle."""
    engine = LLMEngine.from_engine_args(zoo_model(MODEL), **ENGINE_ARGS)
    engine.emit_updates = True
    pipes = [mp.Pipe() for _ in range(3)]
    core = core_cls(engine, [theirs for _, theirs in pipes])
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    control, a, b = (ours for ours, _ in pipes)
    got: dict = {"a": [], "b": []}
    try:
        p = prompts_for(ZOO[MODEL].vocab_size, (9, 14, 11), seed=4)
        b.send(("add", 1, [("b0", p[0], LONG)]))
        _until(b, "added", got["b"])
        a.send(("add", 2, [("a0", p[1], SHORT)]))
        a.send(("add", 3, [("a1", p[2], SHORT)]))
        a.send(("add", 5, [("a2", p[2], LONG)]))
        a.send(("abort", ["a2"]))  # A's own abort of a request it added
        finished: set = set()
        while finished != {"a0", "a1", "a2"}:
            msg = _recv(a)
            got["a"].append(msg)
            if msg[0] == "out":
                finished |= {u[0] for u in msg[1] if u[4] is not None}
        while not any(m[0] == "out" and m[1] for m in got["b"]):  # b0 has produced tokens
            got["b"].append(_recv(b))
        b.close()
        # the core aborts b0 and goes idle; then A hears the stats of an idle engine
        while True:
            msg = _recv(a)
            got["a"].append(msg)
            if msg[0] == "out" and not msg[1] and msg[2]["running"] == 0 and msg[2]["waiting"] == 0:
                break
        a.send(("call", 4, state_and_steps))
        got["state"] = _until(a, "called", got["a"])[2]
        got["owners_left"] = dict(core.owner)  # every request ended: none still owned
        control.send(("stop",))
        thread.join(30)
        assert not thread.is_alive(), "the core did not stop"
    finally:
        if thread.is_alive():
            control.close()
            thread.join(30)
        engine.close()
    return got


def check(got: dict) -> None:
    ids_a = {u[0] for m in got["a"] if m[0] == "out" for u in m[1]}
    ids_b = {u[0] for m in got["b"] if m[0] == "out" for u in m[1]}
    assert ids_a == {"a0", "a1", "a2"}, f"front end A got updates of {sorted(ids_a)}"
    assert ids_b == {"b0"}, f"front end B got updates of {sorted(ids_b)}"
    tokens = {rid: sum(len(u[1]) for m in got["a"] if m[0] == "out" for u in m[1] if u[0] == rid) for rid in ids_a}
    assert tokens["a0"] == tokens["a1"] == 8, tokens
    assert got["owners_left"] == {}, f"requests still owned after they ended: {got['owners_left']}"
    # while B's request ran on alone, A (no updates of its own) still got the running engine's stats
    assert any(m[0] == "out" and not m[1] and m[2]["running"] >= 1 for m in got["a"]), "A got no stats while B ran"
    free, total, live, steps = got["state"]
    assert live == [] and free == total, f"after B left: {free} of {total} blocks free, live {live}"
    # B's request was aborted when B left, not run to its 200 tokens
    assert steps < LONG.max_tokens // 2, f"{steps} steps: B's request ran on after B left"


@pytest.fixture(autouse=True)
def stats_every_step(monkeypatch):
    """Stats to an idle front end at every step (not every 0.5 s): the scenario runs in well
    under a second, and the check on them must not depend on the machine's speed."""
    import nanovllm.engine.core_process as core_process

    monkeypatch.setattr(core_process, "STATS_INTERVAL_S", 0.0)


def test_each_front_end_gets_its_own_requests_and_a_closed_one_is_aborted():
    check(run_scenario(EngineCore))


def test_the_routing_check_catches_a_broadcasting_core():
    with pytest.raises(AssertionError, match="got updates of"):
        check(run_scenario(BroadcastingCore))
