"""Every kernel of the CUDA backend by name, and the argument types each is compiled with.

Importing this module imports ``numba.cuda`` and every kernel module;
`elastic_np.cuda._compile.report` imports it on first use, when the PTX or
the resource report is asked for. The conventions every kernel follows are
in `elastic_np.cuda._device.indices`.
"""

import numpy as np
from numba import types as nbt

from elastic_np.cuda._device import indices
from elastic_np.cuda._simt import backward as simt_backward
from elastic_np.cuda._simt import decode as simt_decode
from elastic_np.cuda._simt import forward as simt_forward
from elastic_np.cuda._tensor_core import backward as tensor_core_backward
from elastic_np.cuda._tensor_core import forward as tensor_core_forward

#: Every kernel of the backend, by name (the PTX and resource reports go through these).
KERNELS = {
    **simt_forward.KERNELS,
    **{kernel.py_func.__name__: kernel for kernel in tensor_core_forward.KERNELS.values()},
    **simt_backward.KERNELS,
    **{kernel.py_func.__name__: kernel for kernel in tensor_core_backward.KERNELS.values()},
    **simt_decode.KERNELS,
}


def signatures(dtype):
    """The argument types each kernel is launched with for ``dtype`` (one specialisation each)."""
    real = nbt.float64 if dtype == np.float64 else nbt.float32

    def arr(ndim, kind=real):
        return nbt.Array(kind, ndim, "C")

    # `elastic_np.cuda._launch.options.launch_options`'s tuple, in the order of the O_* indices
    opts = [None] * indices.O_COUNT
    opts[indices.O_MASK] = arr(4, nbt.uint8)
    opts[indices.O_KV_LENGTHS] = arr(1, nbt.int64)
    opts[indices.O_BAND] = arr(3, nbt.int64)
    opts[indices.O_IOPTS] = arr(1, nbt.int64)
    opts[indices.O_FOPTS] = arr(1)
    opts[indices.O_TAU] = arr(1)
    opts[indices.O_BETA] = arr(1)
    opts[indices.O_BH_CONSTS] = arr(3)
    opts[indices.O_BIAS] = arr(1)
    opts = nbt.Tuple(tuple(opts))
    qkv = (arr(4), arr(4), arr(4))
    dout_lse_delta = nbt.Tuple((arr(4), arr(3), arr(3)))
    tensor_cores = {kernel.py_func.__name__: qkv + (opts, nbt.boolean, arr(4), arr(3))
                    for kernel in tensor_core_forward.KERNELS.values()}
    backward_tc = {kernel.py_func.__name__: qkv + (opts, nbt.boolean, dout_lse_delta, arr(4), arr(4))
                   for kernel in tensor_core_backward.KERNELS.values()}
    return {
        "_forward_kernel": qkv + (opts, nbt.int64, arr(4), arr(3)),
        **backward_tc,
        **tensor_cores,
        "_backward_delta_kernel": (arr(4), arr(4), arr(3), opts, arr(3)),
        "_backward_dq_kernel": qkv + (opts, nbt.int64, dout_lse_delta, arr(4), arr(4), arr(4)),
        "_backward_dkdv_kernel": qkv + (opts, nbt.int64, dout_lse_delta, arr(4), arr(4)),
        "_backward_dbias_kernel": qkv + (opts, dout_lse_delta, arr(1)),
        "_decode_kernel": qkv + (opts, nbt.int64, arr(5), arr(5)),
        "_decode_merge_kernel": (arr(5), arr(5), opts, arr(4), arr(3)),
    }
