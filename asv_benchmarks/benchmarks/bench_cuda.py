"""The numba.cuda kernels (``backend="cuda"``); skipped in ``setup`` without a GPU.

The public entry points copy the result back to the host, so a timing covers
the transfers and the kernels, finished. The kernel is launched once in
``setup`` so that neither compilation nor the CUDA context's start is timed.
"""

from . import common
from .common import DTYPES, VARIANTS, AttentionCase

CUDA_SEQ_LENS = [1024, 4096] if common.PROFILE == "regular" else [256]


class CUDAForward:
    """Forward pass of the CUDA kernel."""

    params = [VARIANTS, CUDA_SEQ_LENS, DTYPES]
    param_names = ["variant", "N", "dtype"]
    timeout = 300

    def setup(self, variant, N, dtype):
        self.case = AttentionCase("cuda", variant, N, dtype)
        common.warm_up(self.case.forward)

    def time_forward(self, variant, N, dtype):
        self.case.forward()


class CUDAForwardBackward:
    """Forward + backward of the CUDA kernel."""

    params = [VARIANTS, CUDA_SEQ_LENS, DTYPES]
    param_names = ["variant", "N", "dtype"]
    timeout = 300

    def setup(self, variant, N, dtype):
        self.case = AttentionCase("cuda", variant, N, dtype)
        common.warm_up(self.case.forward_backward)

    def time_forward_backward(self, variant, N, dtype):
        self.case.forward_backward()
