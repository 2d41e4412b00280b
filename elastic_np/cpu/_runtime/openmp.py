"""The OpenMP runtimes loaded in the process, and asking them to let their idle threads go.

An OpenMP runtime's workers, PyTorch's libgomp among them, keep spinning for
a while after each parallel region, waiting for the next. A kernel call
that starts within that while shares the cores with them (on two cores,
right after a PyTorch operation: docs/performance.rst). Before a
large call runs on the pool (`elastic_np.cpu._runtime.threads.run_tasks`), `quiet`
asks every OpenMP runtime loaded in the process for
``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0): libgomp then ends
the calling thread's team, LLVM's and Intel's runtimes put their threads to
sleep; the next parallel region of that library starts its threads again.
Nothing is loaded to find them: the runtimes are those the process has
mapped already (Linux's ``/proc/self/maps``; on other systems none are found).
"""

import ctypes
import os
import sys

#: ``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``.
_PAUSE_SOFT = 1
#: File names of OpenMP runtimes start with these: GNU, Intel, LLVM.
_RUNTIMES = ("libgomp", "libiomp5", "libomp")

_seen = {"modules": -1, "pauses": ()}


def runtimes():
    """Paths of the OpenMP runtimes mapped into this process, in the order they are mapped."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    paths = []
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        name = os.path.basename(path)
        if name.startswith(_RUNTIMES) and ".so" in name and path not in paths:
            paths.append(path)
    return paths


def _pauses():
    """``omp_pause_resource_all`` of each loaded runtime that has it, found again whenever modules were imported."""
    if len(sys.modules) != _seen["modules"]:
        pauses = []
        for path in runtimes():
            try:
                library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # never loads it
                pause = library.omp_pause_resource_all
            except (OSError, AttributeError):  # unmapped meanwhile, or a runtime older than OpenMP 5.0
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            pauses.append(pause)
        _seen["modules"], _seen["pauses"] = len(sys.modules), tuple(pauses)
    return _seen["pauses"]


def quiet():
    """Ask every loaded OpenMP runtime to let the calling thread's idle workers go; the number asked.

    A runtime that cannot (the calling thread is inside one of its parallel
    regions) says so and is left as it is.
    """
    pauses = _pauses()
    for pause in pauses:
        pause(_PAUSE_SOFT)
    return len(pauses)
