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

A second SIGINT once the first has been held for ``ESCALATE_AFTER_S`` raises at once, wherever it
lands: a step that never ends (a tensor-parallel rank hung in a collective) must not make Ctrl-C
useless (the TP executor then kills its workers). A second one sooner is held like the first.

It acts only in the main thread and only where Python's own SIGINT handler is in place (a caller's
handler is left alone).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator


class DeferredInterrupts:
    ESCALATE_AFTER_S = 2.0  # a step of the engine takes milliseconds to a second or so

    def __init__(self) -> None:
        self.pending = False
        self._active = False
        self._held_since = 0.0

    def __enter__(self) -> DeferredInterrupts:
        self._active = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if self._active:
            signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        # A second Ctrl-C once the first has waited ESCALATE_AFTER_S: the step is not ending (a
        # tensor-parallel rank hung in a collective), so the user gets the interrupt now. A quick
        # double tap inside a step that is ending is held like the first: cut at any bytecode, a
        # step can leave the scheduler half updated (a request and its blocks leaked).
        if self.pending and time.monotonic() - self._held_since >= self.ESCALATE_AFTER_S:
            self.pending = False
            raise KeyboardInterrupt
        if not self.pending:
            self._held_since = time.monotonic()
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
