"""The numba.cuda kernels (``backend="cuda"``); skipped in ``setup`` without a GPU.

The public entry points copy the result back to the host, so a timing covers
the transfers and the kernels, finished. The kernel is launched once in
``setup`` so that neither compilation nor the CUDA context's start is timed.
"""

import numpy as np

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


#: Score modifiers timed on the CUDA kernel, next to the "plain" variant above.
#: The bias shapes: "bias_full" (1, H, N, N), dbias written by the dq kernel;
#: "bias_keys" (N, N) and "bias_padding" (B, 1, 1, N), dbias from the reduction kernel.
MODIFIERS = ["softcap", "alibi", "bias_full", "bias_keys", "bias_padding"]


def modifier_options(modifier, N):
    """Keyword options of `elastic_np.attention` for one entry of `MODIFIERS`."""
    rng = np.random.default_rng(common.SEED + 2)
    if modifier == "softcap":
        return {"softcap": 30.0}
    if modifier == "alibi":
        return {"alibi_slopes": 2.0 ** (-8.0 * np.arange(1, common.HEADS + 1) / common.HEADS)}
    shapes = {
        "bias_full": (common.BATCH, common.HEADS, N, N),
        "bias_keys": (N, N),
        "bias_padding": (common.BATCH, 1, 1, N),
    }
    if modifier in shapes:
        return {"bias": rng.standard_normal(shapes[modifier])}
    raise ValueError(f"unknown modifier {modifier!r}; expected one of {MODIFIERS}")


class CUDAModifiers:
    """Forward and forward + backward of the CUDA kernel with one score modifier."""

    params = [MODIFIERS, CUDA_SEQ_LENS, DTYPES]
    param_names = ["modifier", "N", "dtype"]
    timeout = 300

    def setup(self, modifier, N, dtype):
        self.case = AttentionCase("cuda", "plain", N, dtype)
        self.case.options = modifier_options(modifier, N)
        common.warm_up(self.case.forward_backward)

    def time_forward(self, modifier, N, dtype):
        self.case.forward()

    def time_forward_backward(self, modifier, N, dtype):
        self.case.forward_backward()
