"""Checks built on the policy model and on first principles, shared by the scheduling and
prefix-cache tests.

``run_against_model`` drives the real engine loop (``LLMEngine`` over the fake executor, through
``EngineHarness``) and the independent ``PolicyModel`` with the same arrivals and compares them
after every step, and their counters (``stats()``) at the end.
``check_fcfs`` checks first-come-first-served order with recompute preemption on any trace,
without the model: it needs only who arrived when, and what each step did.

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.properties.fake_runner import kv_chain, next_token
from tests.properties.harness import EngineHarness
from tests.properties.policy_model import ModelRequest, PolicyModel


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0


@dataclass
class StepView:
    """What one step did, as an observer of the trace sees it."""

    scheduled: list[str]
    admitted: list[str]
    preempted: list[str]
    finished: list[str]


def check_fcfs(steps: list[StepView], arrived_before: dict[str, int]) -> None:
    """FCFS with recompute preemption, from a trace: ``arrived_before[rid]`` is the index of the first
    step that could see the request (dict order = arrival order).

    * a step serves its requests in arrival order (running ones are older than waiting ones);
    * a preemption takes the latest arrivals among the running requests; a step that preempts
      admits no one;
    * admissions take the earliest arrivals among the waiting requests, preempted ones included:
      a request that waits (new or preempted) is never overtaken by a later arrival.
    """
    order = {rid: i for i, rid in enumerate(arrived_before)}
    running: list[str] = []
    done: set[str] = set()
    for t, step in enumerate(steps):
        where = f"step {t}"
        ranks = [order[r] for r in step.scheduled]
        assert ranks == sorted(ranks), f"{where}: served out of arrival order: {step.scheduled}"
        for victim in step.preempted:
            assert victim in running, f"{where}: preempted {victim} was not running"
            assert order[victim] == max(order[r] for r in running), (
                f"{where}: preempted {victim} but later arrivals {[r for r in running if order[r] > order[victim]]} kept running"
            )
            running.remove(victim)
        if step.preempted:
            assert not step.admitted, f"{where}: admitted {step.admitted} in a step that preempted {step.preempted}"
        waiting = sorted(
            (r for r, s in arrived_before.items() if s <= t and r not in done and r not in running), key=order.get
        )
        assert step.admitted == waiting[: len(step.admitted)], (
            f"{where}: admitted {step.admitted} while the queue in arrival order is {waiting}"
        )
        running += step.admitted
        for rid in step.finished:
            assert rid in running, f"{where}: {rid} finished but was not running"
            running.remove(rid)
            done.add(rid)


def fake_views(eng: EngineHarness) -> list[StepView]:
    return [
        StepView([r for r, _, _ in h.scheduled], [r for r, _ in h.admitted], list(h.preempted), list(h.finished))
        for h in eng.history
    ]


def run_against_model(cfg: dict, batches, *, vocab_size: int = 3, hash_fn=None, compare: bool = True):
    """``batches``: [(requests added now, steps run after)]; then everything runs to the end.

    Returns (EngineHarness, PolicyModel, arrived_before). Raises AssertionError at the first step
    where the real engine and the model disagree. With ``compare=False`` only the engine runs (the
    harness's own checks stay on): for checks that must not lean on the model.
    """
    eng = EngineHarness(**cfg, vocab_size=vocab_size, hash_fn=hash_fn)
    model = PolicyModel(**cfg, next_token=lambda rid, toks: next_token(kv_chain(toks), vocab_size))
    arrived_before: dict[str, int] = {}

    def step() -> None:
        eng.step()
        if not compare:
            return
        want = model.step()
        got = eng.history[-1]
        where = f"step {got.index}"
        assert want is not None, f"{where}: the engine ran a step the model did not expect"
        assert got.scheduled == want.scheduled, f"{where}: scheduled {got.scheduled}, model {want.scheduled}"
        assert got.preempted == want.preempted, f"{where}: preempted {got.preempted}, model {want.preempted}"
        assert got.admitted == want.admitted, (
            f"{where}: admitted (request, cached tokens) {got.admitted}, model {want.admitted}"
        )
        finished = [(rid, eng.finish_reasons[rid]) for rid in got.finished]
        assert finished == want.finished, f"{where}: finished {finished}, model {want.finished}"
        free = eng.block_manager.num_free_blocks
        assert free == want.num_free_blocks, f"{where}: {free} free blocks, model {want.num_free_blocks}"
        assert eng.block_manager.num_evictions == model.counters["evictions"], (
            f"{where}: {eng.block_manager.num_evictions} evictions so far, model {model.counters['evictions']}"
        )

    for requests, num_steps in batches:
        for r in requests:
            try:
                seq = eng.add_request(
                    list(r.prompt), r.max_tokens, min_tokens=r.min_tokens, stop_token_ids=list(r.stop_token_ids)
                )
            except ValueError:
                continue  # refused by admission control (checked elsewhere)
            arrived_before[seq.request_id] = len(eng.history)
            model.add(
                ModelRequest(seq.request_id, list(r.prompt), r.max_tokens, frozenset(r.stop_token_ids), r.min_tokens)
            )
        for _ in range(num_steps):
            if not eng.has_unfinished:
                break
            step()
    for _ in range(eng.step_bound()):
        if not eng.has_unfinished:
            break
        step()
    assert not eng.has_unfinished, "the engine did not finish within its step bound"
    if not compare:
        return eng, model, arrived_before
    assert model.step() is None, "the engine and the model do not end together"

    stats = eng.engine.stats()
    for name, value in model.counters.items():
        assert stats[name] == value, f"stats()[{name!r}] = {stats[name]}, the model expects {value}"
    for rid, req in model.requests.items():
        seq = eng.requests[rid]
        assert seq.num_cached_tokens == req.num_cached_tokens, (
            f"{rid}: num_cached_tokens {seq.num_cached_tokens}, model {req.num_cached_tokens} (its first admission)"
        )
        assert seq.num_preemptions == req.num_preemptions, (
            f"{rid}: num_preemptions {seq.num_preemptions}, model {req.num_preemptions}"
        )
        assert eng.outputs[rid] == req.tokens[len(req.prompt) :], f"{rid}: tokens differ from the model's"
    return eng, model, arrived_before
