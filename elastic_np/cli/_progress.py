"""A minimal progress bar on stderr for the command-line tool.

The bar stays silent for the first ``delay`` seconds, so that quick runs print
nothing extra; after that it redraws one line (``\\r``) per step. `stage`
announces a step that cannot report progress while it runs, such as the first
JIT compile of a kernel.
"""

import sys
import time


class Progress:
    """A text progress bar.

    Parameters
    ----------
    total : int
        Number of steps.
    label : str
        What is being done, shown before the bar.
    stream : file-like, optional
        Where to draw; ``sys.stderr`` by default.
    delay : float, optional
        Seconds to wait before drawing anything.
    width : int, optional
        Characters in the bar.
    """

    def __init__(self, total, label, *, stream=None, delay=2.0, width=24):
        self.total = max(int(total), 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.delay = delay
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self._drawn = False

    def update(self, step_label="", advance=1):
        """Count ``advance`` finished steps; ``step_label`` names the next one."""
        self.done = min(self.done + advance, self.total)
        if time.perf_counter() - self.start >= self.delay:
            self._draw(step_label)

    def stage(self, message):
        """Print a one-line notice right away (a step without progress of its own)."""
        self._clear()
        print(message, file=self.stream, flush=True)

    def close(self):
        """Finish the bar's line, if it was drawn."""
        if self._drawn:
            self._draw("done")
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def _draw(self, step_label):
        filled = round(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {step_label}"
        self.stream.write("\r" + line[:100].ljust(100))
        self.stream.flush()
        self._drawn = True

    def _clear(self):
        if self._drawn:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self._drawn = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
