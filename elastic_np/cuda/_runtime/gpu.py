"""The GPU as the backend sees it: ``numba.cuda`` and the kernel modules on first use, availability, the GPU's limits.

Imports neither ``numba.cuda`` nor a kernel module when imported: `cuda_module`
imports the one, `kernel_module` the others, when a kernel is to run. Also
the launch configuration that opts a kernel in to more than the default
48 KB of dynamic shared memory (`configured`).
"""

import functools
import importlib

from numba import config as numba_config

from elastic_np._contract._errors import BackendUnavailableError
from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime import sim


INSTALL_HINT = 'install it with `pip install "elastic_np[cuda]"` (numba-cuda with the CUDA 13 toolkit wheels)'


def cuda_module():
    """``numba.cuda``, imported on first use.

    The kernels need the numba-cuda package (the CUDA target that Numba itself
    ships is older and lacks what they use), so its absence is reported even
    where ``from numba import cuda`` would still succeed.
    """
    try:
        import numba_cuda  # noqa: F401
        from numba import cuda
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend 'cuda' needs the numba-cuda package, which could not be imported ({exc}); "
            + INSTALL_HINT
        ) from exc
    return cuda


def kernel_module(name):
    """The kernel module ``elastic_np.cuda.<name>`` (it imports ``numba.cuda``), imported on first use.

    ``"_forward"``, ``"_decode"``, ``"_backward"``, ``"_device"`` (the option
    indices) or ``"_kernels"`` (every kernel by name). Under the simulator its
    missing warp shuffles are installed first (`elastic_np.cuda._runtime.sim`).
    """
    cuda_module()
    if simulator():
        sim.install()  # warp shuffles, which the simulator lacks
    return importlib.import_module(f"elastic_np.cuda.{name}")


def simulator():
    return bool(getattr(numba_config, "ENABLE_CUDASIM", 0))


def is_available():
    """True when a real CUDA GPU and its driver are usable (never under the CUDA simulator).

    Returns
    -------
    bool
    """
    try:
        cuda = cuda_module()
    except BackendUnavailableError:
        return False
    if simulator():
        return False
    try:
        return bool(cuda.is_available())
    except Exception:
        return False


def check_available():
    """Raise `BackendUnavailableError` unless the kernels can run here.

    They run on a usable GPU, or on the CUDA simulator when
    ``NUMBA_ENABLE_CUDASIM=1`` was set before ``numba`` was imported (slow;
    for tests).

    Raises
    ------
    elastic_np.BackendUnavailableError
        Saying what is missing (numba-cuda, the CUDA driver, a GPU) and how to
        install the CUDA extra.
    """
    cuda = cuda_module()
    if simulator():
        return
    try:
        if cuda.is_available():
            return
        cuda.current_context()  # raises with the driver's reason
        reason = "no usable CUDA GPU was found"
    except Exception as exc:
        reason = " ".join(str(exc).split()).rstrip(" :.") or type(exc).__name__
    raise BackendUnavailableError(
        f"backend 'cuda' needs an NVIDIA GPU with its CUDA driver, and here: {reason}. "
        f"On a machine with a GPU, {INSTALL_HINT}; here, use backend='cpu'."
    )


# ---------------------------------------------------------------------------
# Dynamic shared memory beyond the default 48 KB
# ---------------------------------------------------------------------------


def shared_limit():
    """Bytes of dynamic shared memory a block may use when the host sizes its tiles.

    ``MAX_SHARED_BYTES`` when set; else the current GPU's opt-in maximum, and
    ``DEFAULT_SHARED_BYTES`` under the simulator or where no GPU is usable.
    """
    if config.MAX_SHARED_BYTES is not None:
        return config.MAX_SHARED_BYTES
    if not is_available():
        return config.DEFAULT_SHARED_BYTES
    return _device_shared_limit(cuda_module().get_current_device().id)


def compute_capability():
    """The current GPU's compute capability, ``(9, 0)`` under the simulator (whose kernels take every path)."""
    if simulator():
        return (9, 0)
    return _device_capability(cuda_module().get_current_device().id)


def current_device_id():
    """The id of the current device (0 under the simulator)."""
    if simulator():
        return 0
    return cuda_module().get_current_device().id


@functools.cache
def _device_capability(device_id):
    return tuple(cuda_module().get_current_device().compute_capability)


@functools.cache
def _device_shared_limit(device_id):
    return int(cuda_module().get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def blocks(n, size):
    """The blocks of ``size`` that cover ``n`` (``ceil(n / size)``; a grid's size)."""
    return (n + size - 1) // size


def pow2_at_least(n):
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    size = 1
    while size < n:
        size *= 2
    return size


def configured(kernel, blocks, threads, shared):
    """``kernel[blocks, threads, 0, shared]``, opted in first where ``shared`` passes the default limit.

    numba-cuda hands out one launch configuration per (kernel, grid, block,
    stream, shared memory), kept across calls, so the opt-in callback is
    added to it once, not once per call.
    """
    launch = kernel[blocks, threads, 0, shared]
    if shared > config.DEFAULT_SHARED_BYTES and not simulator() and _allow_shared not in launch.pre_launch_callbacks:
        launch.pre_launch_callbacks.append(_allow_shared)
    return launch


_opted_in = {}  # (compiled kernel, device id) -> dynamic shared bytes allowed


def _allow_shared(kernel, launch):
    """Raise the compiled ``kernel``'s dynamic shared-memory limit to the launch's (a pre-launch callback)."""
    function = kernel._codelibrary.get_cufunc()  # numba-cuda has no public accessor for it
    key = (kernel, function.device.id)
    if _opted_in.get(key, 0) < launch.sharedmem:
        from numba.cuda.cudadrv.driver import binding, driver

        attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attribute, launch.sharedmem, function.handle, function.device.id)
        _opted_in[key] = launch.sharedmem
