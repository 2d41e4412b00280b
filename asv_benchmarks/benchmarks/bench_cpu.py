"""The Numba CPU kernels (``backend="cpu"``): time, throughput and accuracy.

Every ``setup`` runs the kernel once, so the timings never include Numba's
compilation. Without the CPU backend in the benchmarked commit, or for an
option it does not implement, ``setup`` raises `NotImplementedError` and asv
marks the benchmark skipped.
"""

import numpy as np

from elastic_np import reference as ref

from . import common
from .common import (
    ACCURACY_DTYPES,
    ACCURACY_SEQ_LEN,
    DTYPES,
    SEQ_LENS,
    VARIANTS,
    AttentionCase,
)


class CPUForward:
    """Forward pass of the CPU kernel, per option set, sequence length and dtype."""

    params = [VARIANTS, SEQ_LENS, DTYPES]
    param_names = ["variant", "N", "dtype"]
    timeout = 300

    def setup(self, variant, N, dtype):
        self.case = AttentionCase("cpu", variant, N, dtype)
        common.warm_up(self.case.forward)

    def time_forward(self, variant, N, dtype):
        self.case.forward()


class CPUBackward:
    """Backward alone and forward + backward of the CPU kernel."""

    params = [VARIANTS, SEQ_LENS, DTYPES]
    param_names = ["variant", "N", "dtype"]
    timeout = 300

    def setup(self, variant, N, dtype):
        self.case = AttentionCase("cpu", variant, N, dtype)
        self.out, self.lse = common.warm_up(self.case.forward)
        common.warm_up(lambda: self.case.backward(self.out, self.lse))

    def time_backward(self, variant, N, dtype):
        self.case.backward(self.out, self.lse)

    def time_forward_backward(self, variant, N, dtype):
        self.case.forward_backward()


class CPUThroughput:
    """Useful GFLOP/s of the CPU kernel (pairs removed by masks are not counted)."""

    params = [VARIANTS, SEQ_LENS, DTYPES]
    param_names = ["variant", "N", "dtype"]
    timeout = 300

    def setup(self, variant, N, dtype):
        self.case = AttentionCase("cpu", variant, N, dtype)
        self.out, self.lse = common.warm_up(self.case.forward)
        common.warm_up(lambda: self.case.backward(self.out, self.lse))

    def track_forward_gflops(self, variant, N, dtype):
        seconds = common.best_time(self.case.forward)
        return self.case.flops() / seconds / 1e9

    track_forward_gflops.unit = "GFLOP/s"

    def track_forward_backward_gflops(self, variant, N, dtype):
        seconds = common.best_time(self.case.forward_backward)
        return self.case.flops(backward=True) / seconds / 1e9

    track_forward_backward_gflops.unit = "GFLOP/s"


class CPUAccuracy:
    """Worst normwise error of the CPU kernel against the float64 oracle.

    ``N = 200`` is not a multiple of any tile, so partial tiles are covered.
    """

    params = [VARIANTS, ACCURACY_DTYPES]
    param_names = ["variant", "dtype"]
    timeout = 300

    def setup(self, variant, dtype):
        self.case = AttentionCase("cpu", variant, ACCURACY_SEQ_LEN, dtype)
        self.out, self.lse = common.warm_up(self.case.forward)
        self.grads = common.warm_up(lambda: self.case.backward(self.out, self.lse))
        c = self.case
        self.oracle_out, self.oracle_lse = ref.attention(c.q, c.k, c.v, **c.options)
        self.oracle_grads = ref.attention_backward(
            c.dout, c.q, c.k, c.v, self.oracle_out, self.oracle_lse, **c.options
        )

    def track_forward_error(self, variant, dtype):
        """Worst of ``out`` and ``lse`` (finite entries) against the oracle."""
        finite = np.isfinite(self.oracle_lse)
        return max(
            common.relative_error(self.out, self.oracle_out),
            common.relative_error(self.lse[finite], self.oracle_lse[finite]),
        )

    track_forward_error.unit = "relative error"

    def track_backward_error(self, variant, dtype):
        """Worst over ``dq, dk, dv, dtau, dbeta`` (and ``dsigma``) against the oracle.

        The kernel's own forward output feeds its backward and the oracle's
        feeds the oracle's, so this is the error a training step sees.
        """
        errors = [
            common.relative_error(getattr(self.grads, name), getattr(self.oracle_grads, name))
            for name in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma")
            if getattr(self.oracle_grads, name) is not None
        ]
        return max(errors)

    track_backward_error.unit = "relative error"


#: Score modifiers benchmarked on the CPU kernel: the option set, by name.
MODIFIERS = ["softcap", "alibi", "bias_full", "bias_full_mT", "bias_nm", "bias_keypad"]


def modifier_options(modifier, N):
    """Keyword options of one entry of `MODIFIERS` for ``N`` queries and keys."""
    B, H = common.BATCH, common.HEADS
    rng = np.random.default_rng(common.SEED + 2)
    if modifier == "softcap":
        return {"softcap": 5.0}
    if modifier == "alibi":
        return {"alibi_slopes": 2.0 ** (-8.0 * np.arange(1, H + 1) / H)}
    if modifier == "bias_full":
        return {"bias": rng.standard_normal((B, H, N, N))}
    if modifier == "bias_full_mT":
        # the same shape laid out along the queries: read at its strides, no transpose
        return {"bias": np.ascontiguousarray(rng.standard_normal((B, H, N, N)).mT).mT}
    if modifier == "bias_nm":
        return {"bias": rng.standard_normal((N, N))}
    if modifier == "bias_keypad":
        # key padding: -inf on a tenth of the keys, broadcast over heads and queries
        return {"bias": np.where(rng.random((B, 1, 1, N)) < 0.1, -np.inf, 0.0)}
    raise ValueError(f"unknown modifier {modifier!r}; expected one of {MODIFIERS}")


class CPUScoreModifiers:
    """Forward, backward and forward + backward of the CPU kernel with a score modifier.

    Compare with `CPUForward` / `CPUBackward` of the "plain" variant; the
    bias is in the inputs' dtype (read without a copy).
    """

    params = [MODIFIERS, SEQ_LENS, DTYPES]
    param_names = ["modifier", "N", "dtype"]
    timeout = 300

    def setup(self, modifier, N, dtype):
        self.case = AttentionCase("cpu", "plain", N, dtype)
        options = modifier_options(modifier, N)
        if "bias" in options:
            options["bias"] = options["bias"].astype(dtype)
        self.case.options = options
        self.out, self.lse = common.warm_up(self.case.forward)
        common.warm_up(lambda: self.case.backward(self.out, self.lse))

    def time_forward(self, modifier, N, dtype):
        self.case.forward()

    def time_backward(self, modifier, N, dtype):
        self.case.backward(self.out, self.lse)

    def time_forward_backward(self, modifier, N, dtype):
        self.case.forward_backward()
