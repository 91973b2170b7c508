"""SIGTERM / SIGINT: stop promptly, but never in the middle of writing a part.

The handler raises `JobInterrupted` where the main thread is, unless a part is
being written; then the signal is held and raised when the write is done. The
runner catches it, flushes the rows already finished and exits 128 + signal.
Once one signal has been raised the job is stopping: a second (a double
Ctrl-C, or SIGTERM then SIGINT) is let go, so that it cannot break into the
final flush before that flush is shielded.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class JobInterrupted(BaseException):
    """A BaseException, as KeyboardInterrupt is: raised wherever the main
    thread is, it must not be taken for the failure of what was running there
    (a tokenizer's `except Exception` made it a row error and the job went on)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopper:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self._depth = 0
        self._pending = None
        self._previous = {}
        self.stopping = False  # a JobInterrupted has been raised: later signals are let go

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only live in the main thread
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, frame):
        if self.stopping:
            return
        if self._depth:
            self._pending = signum
            return
        self._raise(signum)

    def _raise(self, signum: int):
        self.stopping = True
        raise JobInterrupted(signum)

    @contextmanager
    def critical(self):
        """No JobInterrupted inside; a signal that came is raised on leaving."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self._pending is not None:
            signum, self._pending = self._pending, None
            self._raise(signum)

    @contextmanager
    def shielded(self):
        """Like critical(), but a held signal stays held (for the final flush)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
