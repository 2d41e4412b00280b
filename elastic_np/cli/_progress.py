"""Progress on stderr for the command-line tool.

`Progress` counts a command's steps. On a terminal it redraws one line in
place (``\\r``); on a file or a pipe it writes plain lines, one per quarter of
the steps at most. It stays silent for the first ``delay`` seconds, so that
quick runs print nothing extra.

`Progress.begin` announces a long step that has no steps of its own, such as
the first call of the kernels (which compiles them, or loads them from
Numba's cache). Until the next message, a ticker shows how long it has run
and what it is doing: the sub-step given to `Progress.doing` and the
function Numba is compiling (`Compiles`, from Numba's public
``numba:compile`` events). On a terminal the ticker redraws a line every
second; elsewhere it writes a plain line after 10, 30 and 90 seconds.
`first_call_line` then says which it was: compiled, or loaded from the cache.
"""

import shutil
import sys
import threading
import time


def first_call_line(name, seen):
    """``name``'s first call, told by ``seen`` (a `elastic_np._api.compile_report.Watch`): compiled, or loaded."""
    if seen.compiled:
        return (f"{name}: {seen.describe()} in {seen.seconds:.1f} s "
                "(saved to Numba's cache: later runs load them)")
    return f"{name}: nothing compiled (loaded from Numba's cache, or already loaded) in {seen.seconds:.1f} s"


class Compiles:
    """What Numba compiles in this process while the block runs (its ``numba:compile`` events).

    ``now`` is the outermost function being compiled (None between compiles)
    and ``count`` how many functions started compiling.
    """

    def __init__(self):
        self._stack = []
        self.count = 0
        self._lock = threading.Lock()
        self._listener = None

    @property
    def now(self):
        with self._lock:
            return self._stack[0] if self._stack else None

    def describe(self):
        """``"compiling forward_kernel (9 functions compiled)"``, ``"9 functions compiled"``, or ""."""
        now, n = self.now, self.count
        counted = f"{n} function{'s' * (n != 1)} compiled" if n else ""
        return f"compiling {now} ({counted})" if now else counted

    def _start(self, data):
        dispatcher = data.get("dispatcher") if isinstance(data, dict) else None
        name = getattr(getattr(dispatcher, "py_func", None), "__name__", None) or "a function"
        with self._lock:
            self._stack.append(name)
            self.count += 1

    def _end(self):
        with self._lock:
            if self._stack:
                self._stack.pop()

    def __enter__(self):
        from numba.core import event

        compiles = self

        class Listener(event.Listener):
            def on_start(self, ev):
                compiles._start(ev.data)

            def on_end(self, ev):
                compiles._end()

        self._listener = Listener()
        event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc):
        from numba.core import event

        event.unregister("numba:compile", self._listener)
        return False


class _Ticker(threading.Thread):
    """The line of a `Progress.begin` step: its time so far and what it is doing."""

    def __init__(self, progress):
        super().__init__(daemon=True)
        self.progress = progress
        self.compiles = Compiles()
        self._finished = threading.Event()
        self._drawn = False

    def run(self):
        p = self.progress
        start, notes = time.perf_counter(), list(p.notes_after)
        while not self._finished.wait(p.interval):
            elapsed = time.perf_counter() - start
            text = f"  {elapsed:.0f} s so far" + "".join(f"; {t}" for t in (p.now, self.compiles.describe()) if t)
            if p.tty:
                p.stream.write("\r" + text[:p.line_width].ljust(p.line_width))
                p.stream.flush()
                self._drawn = True
            elif notes and elapsed >= notes[0]:
                while notes and elapsed >= notes[0]:
                    notes.pop(0)
                print(text.replace("so far", "and still running", 1), file=p.stream, flush=True)

    def __enter__(self):
        self.compiles.__enter__()
        self.start()
        return self

    def __exit__(self, *exc):
        self._finished.set()
        self.join()
        self.compiles.__exit__(*exc)
        if self._drawn:
            self.progress.stream.write("\r" + " " * self.progress.line_width + "\r")
            self.progress.stream.flush()
        return False


def _isatty(stream):
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


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
        Seconds to wait before drawing the bar.
    width : int, optional
        Characters in the bar.
    tty : bool, optional
        Redraw lines in place; by default, whether ``stream`` is a terminal.
    interval : float, optional
        Seconds between two lines of a `begin` step's ticker.
    notes_after : tuple of float, optional
        Off a terminal, the seconds after which a `begin` step writes a line.
    """

    def __init__(self, total, label, *, stream=None, delay=2.0, width=24, tty=None, interval=1.0,
                 notes_after=(10.0, 30.0, 90.0)):
        self.total = max(int(total), 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.delay = delay
        self.width = width
        self.tty = _isatty(self.stream) if tty is None else bool(tty)
        # a line wider than the terminal would wrap, and "\r" go back to its last row only
        self.line_width = min(100, shutil.get_terminal_size((101, 24)).columns - 1)
        self.interval, self.notes_after = interval, tuple(notes_after)
        self.done = 0
        self.now = ""
        self.start = time.perf_counter()
        self._drawn = False
        self._quarters = 0
        self._ticker = None

    def update(self, step_label="", advance=1):
        """Count ``advance`` finished steps; ``step_label`` names the next one."""
        self._end()
        self.done = min(self.done + advance, self.total)
        if time.perf_counter() - self.start < self.delay:
            return
        if self.tty:
            self._draw(step_label)
        elif 4 * self.done // self.total > self._quarters:
            self._quarters = 4 * self.done // self.total
            print(self._line(step_label), file=self.stream, flush=True)

    def stage(self, message):
        """Print a one-line notice right away (ending a `begin` step)."""
        self._end()
        self._clear()
        print(message, file=self.stream, flush=True)

    def begin(self, message):
        """Print ``message`` and, until the next message, how long this step has run and what it does."""
        self.stage(message)
        self.now = ""
        self._ticker = _Ticker(self).__enter__()

    def doing(self, text):
        """Name what the `begin` step does now (shown by its ticker)."""
        self.now = text

    def close(self):
        """Finish the bar's line, if it was drawn."""
        self._end()
        if self._drawn:
            self._draw("done")
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def _end(self):
        if self._ticker is not None:
            ticker, self._ticker = self._ticker, None
            ticker.__exit__(None, None, None)

    def _line(self, step_label):
        filled = round(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        return f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {step_label}".rstrip()

    def _draw(self, step_label):
        self.stream.write("\r" + self._line(step_label)[:self.line_width].ljust(self.line_width))
        self.stream.flush()
        self._drawn = True

    def _clear(self):
        if self._drawn:
            self.stream.write("\r" + " " * self.line_width + "\r")
            self.stream.flush()
            self._drawn = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
