"""Where one engine step's wall time goes, for ``LLMEngine.step_profiler``.

``LLMEngine.step_profiler`` is None by default (nothing is timed). Set it to a callable and
the engine calls it once per completed step with a dict ``{phase: seconds}`` of that step's
host wall time (``time.perf_counter``):

    schedule              Scheduler.schedule
    build_model_input     the step's tensors and plan
    execute               the runner and the device (synchronous scheduling), or
    launch                queueing the step on the device (async scheduling), then
    wait                  reading its result back (about 0 under synchronous scheduling)
    update_after_step     the scheduler's bookkeeping (counted when the step completes;
                          under async scheduling it runs earlier, in ``_advance``, and is not timed)
    postprocess           tokens appended, stop checks, outputs built

``nanovllm bench --profile-steps`` sums these over a run (``nanovllm/bench/peers.py``).
"""

from __future__ import annotations

import time


class PhaseTimer:
    """Laps of one step: ``lap(phase)`` adds the time since the previous lap (or ``restart``)."""

    __slots__ = ("_last", "phases")

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now


class _Off:
    """The timer of an engine without a profiler: every call does nothing."""

    __slots__ = ()
    phases = None

    def restart(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass


OFF = _Off()
