"""Ctrl-C between engine steps, never inside one.

A KeyboardInterrupt raised at an arbitrary bytecode of ``engine.step()`` can cut a step between
its launch on the device and its bookkeeping (blocks allocated but not recorded, a token launched
but not placed), and the clean-up that follows (abort, drain, close) then works on a half-made
step. ``StepBoundaryInterrupts`` holds a SIGINT that arrives during a step and raises it when the
step has ended:

    guard = StepBoundaryInterrupts()
    with guard:
        outputs = engine.step()
    guard.raise_pending()        # KeyboardInterrupt here, the step whole

It acts only in the main thread and only where Python's own SIGINT handler is in place (a caller's
handler is left alone); outside ``with`` the previous handler is back, so a caller's own code
(between the outputs it is given) is interrupted as usual.
"""

from __future__ import annotations

import signal
import threading


class StepBoundaryInterrupts:
    def __init__(self) -> None:
        self.pending = False
        self._active = False

    def __enter__(self) -> StepBoundaryInterrupts:
        self._active = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if self._active:
            signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        self.pending = True

    def __exit__(self, *exc) -> None:
        if self._active:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._active = False

    def raise_pending(self) -> None:
        """Raise the KeyboardInterrupt held during the last step, if one was."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt
