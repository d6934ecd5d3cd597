"""Ctrl-C held while a block runs, raised after it: between engine steps, never inside one.

A KeyboardInterrupt raised at an arbitrary bytecode of ``engine.step()`` can cut a step between
its launch on the device and its bookkeeping (blocks allocated but not recorded, a token launched
but not placed), and the clean-up that follows (abort, drain, close) then works on a half-made
step. ``DeferredInterrupts`` holds a SIGINT that arrives inside its block and raises it where the
caller says:

    interrupts = DeferredInterrupts()
    with interrupts:                     # installed once, not per step
        while ...:
            outputs = engine.step()
            interrupts.raise_pending()   # KeyboardInterrupt here, the step whole
            with interrupts.released():  # the caller's own code: Ctrl-C as usual
                yield outputs

A second SIGINT while one is held raises at once, wherever it lands: a step that never ends
(a tensor-parallel rank hung in a collective) must not make Ctrl-C useless, and the clean-up then
kills the workers rather than trusting the half-made step.

It acts only in the main thread and only where Python's own SIGINT handler is in place (a caller's
handler is left alone).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class DeferredInterrupts:
    def __init__(self) -> None:
        self.pending = False
        self._active = False

    def __enter__(self) -> DeferredInterrupts:
        self._active = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if self._active:
            signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        if self.pending:  # a second Ctrl-C before the step ended: the step may never end (a rank
            self.pending = False  # hung in a collective), so the user gets their interrupt now
            raise KeyboardInterrupt
        self.pending = True

    def __exit__(self, *exc) -> None:
        if self._active:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._active = False

    def raise_pending(self) -> None:
        """Raise the KeyboardInterrupt held so far, if one was."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Python's own handler for the block (an interrupt raises where it lands), then holding
        again."""
        if not self._active:
            yield
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._hold)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """A Ctrl-C during the block raises KeyboardInterrupt after it (the block runs whole)."""
    interrupts = DeferredInterrupts()
    with interrupts:
        yield
    interrupts.raise_pending()
