"""The CUDA backend's host side: numba.cuda on first use, availability, device arrays, validation.

Imports neither ``numba.cuda`` nor a kernel module when imported: `_cuda`
imports the one, `_kernel_module` the others, when a kernel is to run.
"""

import dataclasses
import functools
import importlib

import numpy as np
from numba import config as numba_config

from elastic_np import reference
from elastic_np._contract import _problem
from elastic_np._contract._errors import BackendUnavailableError
from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime import sim as _sim

#: The dtypes the kernels take (``q``, ``k``, ``v`` share one).
dtypes = ("float32", "float64")

_INSTALL_HINT = 'install it with `pip install "elastic_np[cuda]"` (numba-cuda with the CUDA 13 toolkit wheels)'


def _cuda():
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
            + _INSTALL_HINT
        ) from exc
    return cuda


def _kernel_module(name):
    """The kernel module ``elastic_np.cuda.<name>`` (it imports ``numba.cuda``), imported on first use.

    ``"_forward"``, ``"_decode"``, ``"_backward"``, ``"_device"`` (the option
    indices) or ``"_kernels"`` (every kernel by name). Under the simulator its
    missing warp shuffles are installed first (`elastic_np.cuda._sim`).
    """
    _cuda()
    if _simulator():
        _sim.install()  # warp shuffles, which the simulator lacks
    return importlib.import_module(f"elastic_np.cuda.{name}")


def _simulator():
    return bool(getattr(numba_config, "ENABLE_CUDASIM", 0))


def is_available():
    """True when a real CUDA GPU and its driver are usable (never under the CUDA simulator).

    Returns
    -------
    bool
    """
    try:
        cuda = _cuda()
    except BackendUnavailableError:
        return False
    if _simulator():
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
    cuda = _cuda()
    if _simulator():
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
        f"On a machine with a GPU, {_INSTALL_HINT}; here, use backend='cpu'."
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
    return _device_shared_limit(_cuda().get_current_device().id)


def compute_capability():
    """The current GPU's compute capability, ``(9, 0)`` under the simulator (whose kernels take every path)."""
    if _simulator():
        return (9, 0)
    return _device_capability(_cuda().get_current_device().id)


def _current_device_id():
    """The id of the current device (0 under the simulator)."""
    if _simulator():
        return 0
    return _cuda().get_current_device().id


@functools.cache
def _device_capability(device_id):
    return tuple(_cuda().get_current_device().compute_capability)


@functools.cache
def _device_shared_limit(device_id):
    return int(_cuda().get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


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
    if shared > config.DEFAULT_SHARED_BYTES and not _simulator() and _allow_shared not in launch.pre_launch_callbacks:
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


# ---------------------------------------------------------------------------
# Inputs: NumPy arrays or device arrays
# ---------------------------------------------------------------------------


def _is_device(a):
    if hasattr(a, "__cuda_array_interface__"):
        return True
    if _simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(a, FakeCUDAArray)
    return False


def _as_device_array(a, name):
    """A device array as a numba device array, checked C-contiguous (no copy)."""
    cuda = _cuda()
    if not _simulator():
        a = cuda.as_cuda_array(a)
    if not a.is_c_contiguous():
        raise ValueError(f"`{name}` must be a C-contiguous device array")
    return a


def _to_device(a):
    """``a`` on the device: device arrays as they are, NumPy arrays copied."""
    if _is_device(a):
        return a
    return _cuda().to_device(np.ascontiguousarray(a))


def _device_layout(layout):
    """Raise a `ValueError` for a ``layout`` the kernels cannot read device arrays in."""
    if layout != "bhnd":
        raise ValueError(f"layout={layout!r} is not taken with device arrays (CUDA tensors) yet: the CUDA "
                         "kernels read (B, H, N, D); pass that layout (torch: q.transpose(1, 2)), or "
                         "host arrays, which are copied to the device anyway")


def prepare(q, k, v, *, dtypes=dtypes, **options):
    """Validate the inputs like `elastic_np._contract._problem.prepare`, keeping device arrays on the device.

    With NumPy inputs this is `~elastic_np._contract._problem.prepare`. When any of
    ``q``, ``k``, ``v`` is a device array, shapes and dtypes are validated
    from the array metadata (no copy to the host, no NaN scan), the others
    are copied to the device, and the returned problem holds device arrays.
    A device ``bias`` is validated the same way and kept as it is (in the
    caller's shape, not broadcast) in the problem's ``bias``.
    """
    bias = options.get("bias")
    device_bias = None
    if bias is not None and _is_device(bias):
        device_bias = _as_device_array(bias, "bias")
        # validated from its metadata; the problem carries the device array itself
        options["bias"] = np.broadcast_to(np.zeros((), dtype=device_bias.dtype), device_bias.shape)
    if not any(_is_device(a) for a in (q, k, v)):
        problem = _problem.prepare(q, k, v, dtypes=dtypes, **options)
    else:
        _device_layout(options.get("layout", "bhnd"))
        arrays = []
        for name, a in (("q", q), ("k", k), ("v", v)):
            arrays.append(_as_device_array(a, name) if _is_device(a) else _to_device(np.asarray(a)))
        placeholders = [np.broadcast_to(np.zeros((), dtype=a.dtype), a.shape) for a in arrays]
        problem = _problem.prepare(*placeholders, dtypes=dtypes, check_finite=False, **options)
        problem = dataclasses.replace(problem, q=arrays[0], k=arrays[1], v=arrays[2])
    if device_bias is not None:
        problem = dataclasses.replace(problem, bias=device_bias)
    return problem


def check_backward_arrays(p, dout, out, lse, dtype=None, dlse=None):
    """Validate ``dout``, ``out``, ``lse`` and ``dlse``; device arrays stay on the device.

    NumPy arrays with a NumPy problem go through
    `elastic_np.reference.check_backward_arrays`; otherwise shapes and dtypes
    are checked from the metadata and NumPy arrays are copied to the device.
    Returns ``(dout, out, lse, dlse)``, ``dlse`` None when it was.
    """
    if not any(_is_device(a) for a in (p.q, dout, out, lse, dlse)):
        return reference.check_backward_arrays(p, dout, out, lse, dtype=dtype, dlse=dlse)
    _device_layout(p.layout)
    named = list(zip(p.backward_shapes, (dout, out, lse)))
    if dlse is not None:
        named.append((("dlse", p.backward_shapes[2][1]), dlse))
    arrays = []
    for (name, shape), a in named:
        a = _as_device_array(a, name) if _is_device(a) else _to_device(np.asarray(a))
        if tuple(a.shape) != shape:
            raise ValueError(f"`{name}` must have shape {shape}, got {tuple(a.shape)}")
        if a.dtype != p.dtype:
            raise TypeError(f"`{name}` has dtype {a.dtype}, expected {p.dtype} like `q`")
        arrays.append(a)
    return (*arrays, None) if dlse is None else tuple(arrays)

