"""Telling a Numba compile from a cache load, and saying so: once through `warnings`, always through `logging`.

A kernel's first call in a process either compiles it (seconds) or loads it
from Numba's on-disk cache (a fraction of a second). `watch` listens to
Numba's public event API for compiler passes, which run only when something
compiles, and `reported` logs one INFO line on the ``"elastic_np"`` logger
when a call compiled: what, for which dtype, how many functions, how long.
The first compile of the package's code in a process within a `reported`
block, outside `unannounced` ones (`elastic_np.warmup`'s), is announced
as it starts, with a `~elastic_np.CompileWarning` pointing at the caller's
line (`NOTICE`).
"""

import contextlib
import logging
import sys
import threading
import time
import warnings

from elastic_np._contract._errors import CompileWarning

logger = logging.getLogger("elastic_np")

_PASS_EVENTS = (("numba.core.event", "numba:run_pass"), ("numba.cuda.core.event", "numba-cuda:run_pass"))


#: The function sets of the `watch` blocks now open, in every thread (a compile may run in a pool thread).
_open = []
_open_lock = threading.Lock()
#: The event modules whose pass events reach `_listener`'s listeners: registered once each.
_registered = set()


def _listener(module):
    """A listener of event ``module`` (each Numba package checks its own base class) adding to every open watch.

    A compile of the package's code also makes `NOTICE`'s announcement, when due.
    """

    class Compiled(module.Listener):
        def on_start(self, ev):
            data = ev.data if isinstance(ev.data, dict) else {}
            with _open_lock:
                for functions in _open:
                    functions.add(data.get("qualname"))
            if NOTICE.due and NOTICE.blocks and str(data.get("module")).startswith("elastic_np"):
                NOTICE.announce()

        def on_end(self, ev):
            pass

    return Compiled()


def _register():
    """Register the listeners of the Numba packages loaded so far, once each, not on every call."""
    for module_name, kind in _PASS_EVENTS:
        module = sys.modules.get(module_name)
        if module is not None and module_name not in _registered:
            with _open_lock:
                if module_name not in _registered:
                    module.register(kind, _listener(module))
                    _registered.add(module_name)


class Watch:
    """What `watch` saw: ``compiled`` (the names of the functions compiled) and ``seconds``."""

    def __init__(self):
        self.compiled = frozenset()
        self.seconds = 0.0

    def describe(self):
        """``"compiled 12 functions (forward_kernel)"`` (the kernels and stage entry points named), or ``"no compile"``."""
        n = len(self.compiled)
        if not n:
            return "no compile"
        units = sorted(str(name).lstrip("_") for name in self.compiled if str(name).endswith(("_kernel", "_entry")))
        return f"compiled {n} function{'s' * (n != 1)}" + (f" ({', '.join(units)})" if units else "")

    def summary(self):
        """``"6.4 s (compiled 35 functions ...)"`` or ``"0.3 s (loaded from Numba's cache)"``."""
        source = self.describe() if self.compiled else "no compile: loaded from Numba's cache or already loaded"
        return f"{self.seconds:.2f} s ({source})"


def watch():
    """Within the block, record whether Numba compiled anything (CPU or, when loaded, CUDA) and the time taken.

    Yields a `Watch`, filled in when the block ends.
    """
    return _Watching()


class _Watching:
    """`watch`'s block (a class: cheaper on every call than a generator's context manager)."""

    __slots__ = ("seen", "functions", "start")

    def __enter__(self):
        _register()
        self.seen, self.functions = Watch(), set()
        self.start = time.perf_counter()
        with _open_lock:
            _open.append(self.functions)
        return self.seen

    def __exit__(self, *exc_info):
        self.seen.seconds = time.perf_counter() - self.start
        with _open_lock:
            del _open[next(at for at, open_set in enumerate(_open) if open_set is self.functions)]
            self.seen.compiled = frozenset(self.functions)
        return False


class _Notice:
    """The announcement of a process's first compile: ``due`` until made (a test suite may clear it).

    ``blocks``: the open `reported` blocks that would announce one, each
    ``[backend, what, dtype, caller's frame, deferred exception, cached]``;
    ``quiet``: how many `unannounced` blocks are open (in any thread).
    """

    def __init__(self):
        self.due, self.blocks, self.quiet, self.lock = True, [], 0, threading.Lock()

    def opened(self, backend, what, dtype, cached=True):
        """A block's entry, or None when nothing is due: the caller is the first frame outside the package."""
        if not self.due:
            return None
        entry = [backend, what, dtype, sys._getframe(1), None, cached]  # frame walked out by `announce`, if ever
        with self.lock:
            self.blocks.append(entry)
        return entry

    def closed(self, entry):
        """Forget an entry of `opened`; the exception the warning raised within it (an "error" filter), if any."""
        if entry is None:
            return None
        with self.lock:
            self.blocks.remove(entry)
        entry[3] = None
        return entry[4]

    def announce(self):
        """Warn about the compile now starting, in the newest open block, unless quiet or made already."""
        with self.lock:
            if not (self.due and self.blocks) or self.quiet:
                return
            self.due = False
            entry = self.blocks[-1]
            backend, what, dtype, frame = entry[:4]
            cached = entry[5]
        while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL:
            frame = frame.f_back
        once = ("once (Numba saves it to its cache, from which later processes load it); compile ahead with "
                "elastic_np.warmup() or `elastic-np warmup`" if cached else
                "once a process (a kernel specialised on a user's function is not cached)")
        message = (f"elastic_np is compiling the {backend} backend's {what} for {dtype}: seconds, {once}, silence this "
                   "with warnings.filterwarnings('ignore', category=elastic_np.CompileWarning); logging at INFO level "
                   "on the 'elastic_np' logger has details")
        where = {"filename": "elastic_np", "lineno": 0} if frame is None else {
            "filename": frame.f_code.co_filename, "lineno": frame.f_lineno, "module": frame.f_globals.get("__name__"),
            "registry": frame.f_globals.setdefault("__warningregistry__", {}),
        }
        try:
            warnings.warn_explicit(message, CompileWarning, **where)
        except Exception as exc:  # noqa: BLE001 (raised in the caller's thread when its block ends, not in Numba)
            entry[4] = exc


#: The top-level packages whose frames the announcement skips to find the caller.
_INTERNAL = ("elastic_np", "contextlib")

#: The announcement of the process's first compile (`reported` blocks, `unannounced`).
NOTICE = _Notice()


@contextlib.contextmanager
def unannounced():
    """Within the block, compiles are not announced (they are what the caller asked for); `NOTICE` stays due."""
    with NOTICE.lock:
        NOTICE.quiet += 1
    try:
        yield
    finally:
        with NOTICE.lock:
            NOTICE.quiet -= 1


def reported(backend, what, dtype, cached=True):
    """`watch` the block; when it compiled, one INFO line: ``backend``, ``what``, ``dtype``, functions, seconds;
    ``cached``: whether Numba caches what it compiles (not a kernel specialised on a user's function).

    The first compile of the process (outside `unannounced` blocks) is also
    announced as it starts: a `~elastic_np.CompileWarning` pointing at the
    first caller outside the package.
    """
    return _Reported(backend, what, dtype, cached)


class _Reported:
    """`reported`'s block."""

    __slots__ = ("backend", "what", "dtype", "cached", "entry", "watching", "seen")

    def __init__(self, backend, what, dtype, cached):
        self.backend, self.what, self.dtype, self.cached = backend, what, dtype, cached

    def __enter__(self):
        self.entry = NOTICE.opened(self.backend, self.what, self.dtype, self.cached)
        self.watching = _Watching()
        self.seen = self.watching.__enter__()
        return self.seen

    def __exit__(self, *exc_info):
        try:
            self.watching.__exit__(*exc_info)
        finally:
            deferred = NOTICE.closed(self.entry)
        if deferred is not None:
            raise deferred
        seen = self.seen
        if seen.compiled:
            logger.info(
                "%s backend: %s for %s: %s in %.1f s (%s)", self.backend, self.what, self.dtype, seen.describe(),
                seen.seconds, "saved to Numba's cache; later processes load it" if self.cached else
                "specialised on a user's function: not cached, compiled again in each process",
            )
            logger.debug("compiled: %s", ", ".join(sorted(str(name) for name in seen.compiled)))
        return False
