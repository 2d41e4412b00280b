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


def _listener(module, functions, lock):
    """A listener of event ``module`` (each Numba package checks its own base class) adding to ``functions``."""

    class Compiled(module.Listener):
        def on_start(self, ev):
            with lock:
                functions.add(ev.data.get("qualname") if isinstance(ev.data, dict) else None)

        def on_end(self, ev):
            pass

    return Compiled()


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
    seen, functions, lock = Watch(), set(), threading.Lock()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        for module_name, kind in _PASS_EVENTS:
            module = sys.modules.get(module_name)
            if module is not None:
                stack.enter_context(module.install_listener(kind, _listener(module, functions, lock)))
        try:
            yield seen
        finally:
            seen.seconds = time.perf_counter() - start
            with lock:
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
