"""The CPU kernel next to a naive NumPy attention and PyTorch's SDPA.

Same inputs (one seed), same shapes, same dtype: one graph per benchmark shows
the three implementations. The torch cases skip in ``setup`` when torch is not
installed; the kernel cases skip when the CPU backend is unavailable.
"""

from . import common
from .common import DTYPES, LONG_SEQ_LENS, SEQ_LENS, AttentionCase

KERNEL, NAIVE, TORCH = "cpu kernel", "naive numpy", "torch sdpa"

try:  # imported once with the suite, not in every benchmark process
    import torch  # noqa: F401
except ImportError:
    pass


def _implementation(impl, causal, N, dtype, backward=False):
    """A no-argument callable running ``impl`` on the seeded inputs, already warmed up."""
    variant = "causal" if causal else "plain"
    if impl == KERNEL:
        case = AttentionCase("cpu", variant, N, dtype)
        fn = case.forward_backward if backward else case.forward
    elif impl == NAIVE:
        if backward:
            raise NotImplementedError("the naive NumPy attention has no backward")
        bench = common.require_bench_helpers()
        q, k, v = common.make_inputs(N, dtype)

        def fn():
            return bench.naive_attention(q, k, v, causal=causal)

    elif impl == TORCH:
        common.require_torch()
        bench = common.require_bench_helpers()
        q, k, v = common.make_inputs(N, dtype)
        dout = common.make_dout(N, dtype)

        def fn():
            return bench.torch_sdpa(q, k, v, causal=causal, backward=backward, dout=dout)

    else:
        raise ValueError(f"unknown implementation {impl!r}")
    common.warm_up(fn)
    return fn


class Forward:
    """Attention forward: CPU kernel vs naive NumPy vs torch SDPA."""

    params = [[KERNEL, NAIVE, TORCH], [False, True], SEQ_LENS, DTYPES]
    param_names = ["implementation", "causal", "N", "dtype"]
    timeout = 300

    def setup(self, impl, causal, N, dtype):
        self.fn = _implementation(impl, causal, N, dtype)

    def time_forward(self, impl, causal, N, dtype):
        self.fn()


class ForwardBackward:
    """Attention forward + backward: CPU kernel vs torch SDPA (autograd)."""

    params = [[KERNEL, TORCH], [False, True], SEQ_LENS, DTYPES]
    param_names = ["implementation", "causal", "N", "dtype"]
    timeout = 300

    def setup(self, impl, causal, N, dtype):
        self.fn = _implementation(impl, causal, N, dtype, backward=True)

    def time_forward_backward(self, impl, causal, N, dtype):
        self.fn()


class LongSequenceMemory:
    """Peak memory of a long causal sequence: the kernel streams, naive NumPy holds ``N x N``.

    asv's ``peakmem_`` is the process's peak resident size, so imports and the
    seeded inputs (the same for every implementation) are included; the
    difference between implementations is what the call itself needs. The
    kernel's warm-up compilation happens in ``setup_cache``, in another process
    (Numba's on-disk cache), so that it does not count here.
    """

    params = [[KERNEL, NAIVE, TORCH], LONG_SEQ_LENS]
    param_names = ["implementation", "N"]
    timeout = 300

    def setup_cache(self):
        try:
            AttentionCase("cpu", "causal", 64, "float32").forward()
        except NotImplementedError as exc:
            return f"kernel unavailable: {exc}"
        return "kernel compiled"

    def setup(self, _, impl, N):
        variant = "causal"
        if impl == KERNEL:
            self.case = AttentionCase("cpu", variant, N, "float32")
            # Compile (or load from the on-disk cache) on a tiny problem only.
            common.warm_up(AttentionCase("cpu", variant, 64, "float32").forward)
            self.fn = self.case.forward
        elif impl == NAIVE:
            bench = common.require_bench_helpers()
            q, k, v = common.make_inputs(N, "float32")
            self.fn = lambda: bench.naive_attention(q, k, v, causal=True)
        else:
            common.require_torch()
            bench = common.require_bench_helpers()
            q, k, v = common.make_inputs(N, "float32")
            bench.torch_sdpa(*common.make_inputs(64, "float32"), causal=True)
            self.fn = lambda: bench.torch_sdpa(q, k, v, causal=True)

    def peakmem_forward(self, _, impl, N):
        self.fn()
