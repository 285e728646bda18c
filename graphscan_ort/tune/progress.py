"""tune's progress line: where a long run is, on a terminal only.

While stderr is a terminal, one line shows the stage, the count and the elapsed time,
rewritten in place and erased at the end. In a pipe or in CI nothing is written:
stderr stays graphscan's one line on failure and empty on success, as docs/SPEC.md
says.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """One line of progress on ``stream`` (default: stderr), only when it is a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(self.stream is not None and getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.shown = False

    def show(self, stage: str, done: int | None = None, total: int | None = None) -> None:
        """``graphscan: tune: <stage> <done>/<total>, <m:ss>`` in place of the last line."""
        if not self.enabled:
            return
        elapsed = int(time.monotonic() - self.start)
        count = f" {done}/{total}" if done is not None and total is not None else ""
        self.write(f"\rgraphscan: tune: {stage}{count}, {elapsed // 60}:{elapsed % 60:02d}\x1b[K")
        self.shown = True

    def close(self) -> None:
        """Erase the line, so what follows (the answer, an error line) starts clean."""
        if self.shown:
            self.write("\r\x1b[K")
            self.shown = False

    def write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a terminal gone: progress is not worth an error
            self.enabled = False
