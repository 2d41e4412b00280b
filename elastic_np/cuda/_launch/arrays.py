"""The CUDA backend's inputs: NumPy arrays or device arrays, validated, on the device.

NumPy inputs are copied to the GPU and the results copied back as NumPy
arrays. Device arrays (anything with ``__cuda_array_interface__``: numba
device arrays, CuPy arrays, PyTorch CUDA tensors) must be C-contiguous; they
are used in place, validated from their metadata (no copy to the host, no
NaN or inf scan), and when any input is a device array the results are
numba device arrays, with no host round trip (NumPy inputs next to them are
copied to the device). ``mask`` and ``kv_lengths`` are small option arrays
taken from the host. ``bias`` may be a NumPy array (its distinct entries are
copied to the device, in the kernel dtype) or a C-contiguous device array
of the kernel dtype, used in place (one of another dtype makes a round trip
through the host to be converted); with a device bias the results are
device arrays, ``dbias`` too.
"""

import dataclasses

import numpy as np

from elastic_np import reference
from elastic_np._contract import _problem
from elastic_np.cuda._runtime.gpu import cuda_module, simulator


#: The dtypes the kernels take (``q``, ``k``, ``v`` share one).
dtypes = ("float32", "float64")


def is_device(a):
    if hasattr(a, "__cuda_array_interface__"):
        return True
    if simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(a, FakeCUDAArray)
    return False


def _as_device_array(a, name):
    """A device array as a numba device array, checked C-contiguous (no copy)."""
    cuda = cuda_module()
    if not simulator():
        a = cuda.as_cuda_array(a)
    if not a.is_c_contiguous():
        raise ValueError(f"`{name}` must be a C-contiguous device array")
    return a


def to_device(a):
    """``a`` on the device: device arrays as they are, NumPy arrays copied."""
    if is_device(a):
        return a
    return cuda_module().to_device(np.ascontiguousarray(a))


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
    if bias is not None and is_device(bias):
        device_bias = _as_device_array(bias, "bias")
        # validated from its metadata; the problem carries the device array itself
        options["bias"] = np.broadcast_to(np.zeros((), dtype=device_bias.dtype), device_bias.shape)
    if not any(is_device(a) for a in (q, k, v)):
        problem = _problem.prepare(q, k, v, dtypes=dtypes, **options)
    else:
        _device_layout(options.get("layout", "bhnd"))
        arrays = []
        for name, a in (("q", q), ("k", k), ("v", v)):
            arrays.append(_as_device_array(a, name) if is_device(a) else to_device(np.asarray(a)))
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
    if not any(is_device(a) for a in (p.q, dout, out, lse, dlse)):
        return reference.check_backward_arrays(p, dout, out, lse, dtype=dtype, dlse=dlse)
    _device_layout(p.layout)
    named = list(zip(p.backward_shapes, (dout, out, lse)))
    if dlse is not None:
        named.append((("dlse", p.backward_shapes[2][1]), dlse))
    arrays = []
    for (name, shape), a in named:
        a = _as_device_array(a, name) if is_device(a) else to_device(np.asarray(a))
        if tuple(a.shape) != shape:
            raise ValueError(f"`{name}` must have shape {shape}, got {tuple(a.shape)}")
        if a.dtype != p.dtype:
            raise TypeError(f"`{name}` has dtype {a.dtype}, expected {p.dtype} like `q`")
        arrays.append(a)
    return (*arrays, None) if dlse is None else tuple(arrays)
