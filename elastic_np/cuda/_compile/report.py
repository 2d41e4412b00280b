"""The compile-only reports: every kernel's PTX, what its compiled code uses, the shared memory it asks for.

No GPU needed. `ptx` compiles every kernel, for each dtype, to PTX for a compute
capability with numba-cuda's NVVM; `resources` assembles that PTX with
nvJitLink and reads the assembler's report (registers per thread, stack
frame, spills, static shared memory); `dynamic_shared_bytes` gives the
shared memory each kernel asks for at launch. All three are re-exported by
`elastic_np.cuda`, and ``python -m elastic_np.cuda --ptx`` / ``--resources``
print them.
"""

import contextlib
import functools
import re
import types

import numpy as np

from elastic_np._contract._errors import BackendUnavailableError
from elastic_np.cuda._launch import layouts, plan
from elastic_np.cuda._launch.arrays import dtypes
from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime.gpu import INSTALL_HINT, cuda_module, is_available, kernel_module, simulator


def ptx(cc=(9, 0)):
    """Compile every kernel, for each dtype, to PTX for compute capability ``cc``.

    Needs no GPU: numba-cuda's NVVM does the work.

    Parameters
    ----------
    cc : (int, int), optional
        Compute capability, e.g. ``(8, 0)`` for A100 or ``(9, 0)`` for H100.

    Returns
    -------
    dict of str to str
        ``"<kernel>[<dtype>]"`` to its PTX text.

    Raises
    ------
    elastic_np.BackendUnavailableError
        Without numba-cuda, or under the CUDA simulator (which compiles nothing).
    """
    cuda = cuda_module()
    if simulator():
        raise BackendUnavailableError("ptx() cannot compile under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    return dict(_ptx(cuda, tuple(int(c) for c in cc)))


@functools.lru_cache(maxsize=None)
def _ptx(cuda, cc):
    """`ptx`'s result, compiled once per capability in a process."""
    kernels = kernel_module("_compile.kernels")
    result = {}
    with _device_functions_compiled_for(cc):
        for dtype in dtypes:
            signatures = kernels.signatures(np.dtype(dtype))
            for name, kernel in kernels.KERNELS.items():
                code, _ = cuda.compile_ptx(kernel.py_func, signatures[name], cc=cc)
                result[f"{name}[{dtype}]"] = code
    return result


#: What `resources` reads from the assembler's report of each kernel.
_RESOURCE_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
    "static_shared_bytes": r"(\d+) bytes smem",
}


def resources(cc=(9, 0)):
    """Registers per thread, stack, spills and static shared memory of every kernel, from its SASS.

    Compiles each kernel to PTX (`ptx`) and assembles it for ``sm_<cc>`` with
    nvJitLink (``cuda.core``'s `Linker`, verbose), which needs no GPU, and
    reads the assembler's report. ``stack_bytes`` is the per-thread local
    memory frame (local arrays that were not promoted to registers, and
    spills); ``spill_*_bytes`` the spills alone; ``static_shared_bytes`` the
    shared memory the compiled code reserves (the dynamic shared memory is
    sized at launch: `dynamic_shared_bytes`).

    Parameters
    ----------
    cc : (int, int), optional

    Returns
    -------
    dict of str to dict
        ``"<kernel>[<dtype>]"`` to ``{"registers": int, "stack_bytes": int,
        "spill_store_bytes": int, "spill_load_bytes": int,
        "static_shared_bytes": int, "spills": bool}``.

    Raises
    ------
    elastic_np.BackendUnavailableError
        Without numba-cuda or ``cuda.core`` with nvJitLink, or under the simulator.
    """
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
    except ImportError as exc:
        raise BackendUnavailableError(f"resources() needs cuda.core with nvJitLink ({exc}); " + INSTALL_HINT) from exc
    arch = f"sm_{int(cc[0])}{int(cc[1])}"
    report = {}
    for name, code in ptx(cc=cc).items():
        linker = Linker(ObjectCode.from_ptx(code.encode()), options=LinkerOptions(arch=arch, verbose=True))
        linker.link("cubin")
        log = linker.get_info_log()
        entry = {}
        for field, pattern in _RESOURCE_PATTERNS.items():
            found = re.search(pattern, log)
            if found is None:
                raise RuntimeError(f"{name}: no {field!r} in the assembler's report:\n{log}")
            entry[field] = int(found.group(1))
        entry["spills"] = entry["spill_store_bytes"] > 0 or entry["spill_load_bytes"] > 0
        report[name] = entry
    return report


def dynamic_shared_bytes(D, Dv, dtype, decode=(1, 32, 8, 1, 8192)):
    """Dynamic shared memory per block of each kernel at head dims ``D``, ``Dv`` (with the config's tiles).

    The decode kernels' at the decoding shape ``decode = (B, H, Hkv, N, M)``.

    Returns
    -------
    dict of str to (int, int, int)
        Kernel name to ``(threads per block, tile, bytes)``: the tile is the
        one a block loops over (keys for the forward, ``dq`` and decode
        kernels, queries for ``dk``/``dv``), the merge kernel's its number of
        key splits; the dbias kernel's is its bound (``DBIAS_THREADS``
        threads). The delta kernel uses none.
    """
    itemsize = np.dtype(dtype).itemsize
    threads, tile = plan.forward_tiles(itemsize, D, Dv)
    result = {"_forward_kernel": (threads, tile, layouts.forward_elements(threads, tile, D, Dv) * itemsize)}
    for name, kind in (("_backward_dq_kernel", "dq"), ("_backward_dkdv_kernel", "dkdv")):
        threads, rows, cols = plan.backward_tiles(kind, itemsize, D, Dv)
        result[name] = (threads, cols, layouts.backward_elements(kind, rows, cols, D, Dv) * itemsize)
    result["_backward_dbias_kernel"] = (config.DBIAS_THREADS, 1, config.DBIAS_THREADS * itemsize)
    B, H, Hkv, N, M = decode
    rows = H // Hkv * N
    rows_blk, tpr = plan.decode_geometry(rows, D, Dv, itemsize)
    n_split = plan.decode_splits(B * Hkv * -(-rows // rows_blk), M)
    result["_decode_kernel"] = (rows_blk * tpr, tpr * config.DECODE_REG_N,
                                layouts.decode_elements(rows_blk, tpr, D, Dv) * itemsize)
    result["_decode_merge_kernel"] = (max(1, min(config.DECODE_MERGE_THREADS, Dv)), n_split, n_split * itemsize)
    return result


@contextlib.contextmanager
def _device_functions_compiled_for(cc):
    """Let ``compile_ptx`` compile the kernels' device functions without a GPU.

    numba-cuda compiles a called device function for the compute capability of
    the current device, which needs a driver; `compile_ptx` itself does not.
    Inside this context the device functions see a device of capability ``cc``.
    """
    from numba.cuda import dispatcher

    current = dispatcher.get_current_device
    if is_available():
        yield
        return
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = current
