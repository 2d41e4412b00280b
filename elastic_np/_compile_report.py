"""Telling a Numba compile from a cache load, and saying so through `logging`.

A kernel's first call in a process either compiles it (seconds) or loads it
from Numba's on-disk cache (a fraction of a second). `watch` listens to
Numba's public event API for compiler passes, which run only when something
compiles, and `reported` logs one INFO line on the ``"elastic_np"`` logger
when a call compiled: what, for which dtype, how many functions, how long.
"""

import contextlib
import logging
import sys
import threading
import time

logger = logging.getLogger("elastic_np")

_PASS_EVENTS = (("numba.core.event", "numba:run_pass"), ("numba.cuda.core.event", "numba-cuda:run_pass"))


#: The function sets of the `watch` blocks now open, in every thread (a compile may run in a pool thread).
_open = []
_open_lock = threading.Lock()
#: The event modules whose pass events reach `_listener`'s listeners: registered once each.
_registered = set()


def _listener(module):
    """A listener of event ``module`` (each Numba package checks its own base class) adding to every open watch."""

    class Compiled(module.Listener):
        def on_start(self, ev):
            name = ev.data.get("qualname") if isinstance(ev.data, dict) else None
            with _open_lock:
                for functions in _open:
                    functions.add(name)

        def on_end(self, ev):
            pass

    return Compiled()


def _register():
    """Register the listeners of the Numba packages loaded so far, once each (a listener per call cost tens of us)."""
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


@contextlib.contextmanager
def watch():
    """Within the block, record whether Numba compiled anything (CPU or, when loaded, CUDA) and the time taken.

    Yields a `Watch`, filled in when the block ends.
    """
    _register()
    seen, functions = Watch(), set()
    start = time.perf_counter()
    with _open_lock:
        _open.append(functions)
    try:
        yield seen
    finally:
        seen.seconds = time.perf_counter() - start
        with _open_lock:
            del _open[next(at for at, open_set in enumerate(_open) if open_set is functions)]
            seen.compiled = frozenset(functions)


@contextlib.contextmanager
def reported(backend, what, dtype):
    """`watch` the block; when it compiled, one INFO line: ``backend``, ``what``, ``dtype``, functions, seconds."""
    with watch() as seen:
        yield seen
    if seen.compiled:
        logger.info(
            "%s backend: %s for %s: %s in %.1f s (saved to Numba's cache; later processes load it)",
            backend, what, dtype, seen.describe(), seen.seconds,
        )
        logger.debug("compiled: %s", ", ".join(sorted(str(name) for name in seen.compiled)))
