"""Decoding: few new queries against a long KV cache, beside torch SDPA and a streaming read.

Causal, grouped-query heads. ``Decode`` times each implementation on its own
graph; ``DecodeRatios`` measures the CPU kernel side by side with torch and
with a streaming read of the cache's bytes, interleaved in one process, and
tracks the two ratios (the figures the performance page quotes), which are
steadier on a shared machine than times taken in separate processes.
"""

from . import common
from .common import DTYPES

try:  # the decode measurements, in the tools' package since it has one
    import elastic_np.cli._bench_decode as _bench_decode
except ImportError:
    try:  # before: at the top of the package; they appeared with the decode kernel
        from elastic_np import _bench_decode
    except ImportError:  # pragma: no cover - only on older commits
        _bench_decode = None

try:  # imported once with the suite, not in every benchmark process
    import torch  # noqa: F401
except ImportError:
    pass

#: "B,H,Hkv,N,M,D" per profile: the inference issue's shapes, or small ones.
SHAPES = {
    "regular": ["1,32,8,1,8192,128", "4,32,8,1,4096,128", "1,32,8,16,8192,128"],
    "quick": ["1,8,2,1,1024,64", "1,8,2,16,1024,64"],
}[common.PROFILE]
KERNEL, TORCH, READ = "cpu kernel", "torch sdpa", "streaming read"


def _require_decode():
    if _bench_decode is None:
        raise NotImplementedError("elastic_np.cli._bench_decode is not in this version of the package")
    common.require_backend("cpu")
    return _bench_decode


class Decode:
    """Time of one decoding call (the streaming read: reading as many bytes as the cache)."""

    params = [[KERNEL, TORCH, READ], SHAPES, DTYPES]
    param_names = ["implementation", "shape", "dtype"]
    timeout = 300

    def setup(self, impl, shape, dtype):
        bench = _require_decode()
        shape = bench.parse_shape(shape)
        q, k, v = bench.make_inputs(shape, dtype)
        self.read = None
        if impl == KERNEL:
            import elastic_np

            def fn():
                return elastic_np.attention(q, k, v, causal=True, backend="cpu")

        elif impl == TORCH:
            common.require_torch()
            fn = bench.torch_decode(q, k, v)
        else:
            from elastic_np import cpu

            self.read = fn = bench.StreamingRead(k.nbytes + v.nbytes, cpu.thread_count(), dtype)
        self.fn = fn
        common.warm_up(fn)

    def teardown(self, impl, shape, dtype):
        if self.read is not None:
            self.read.pool.shutdown()

    def time_decode(self, impl, shape, dtype):
        self.fn()


class DecodeRatios:
    """The CPU kernel over torch SDPA and over a streaming read, side by side (medians of rounds)."""

    params = [SHAPES, DTYPES]
    param_names = ["shape", "dtype"]
    timeout = 600

    def setup(self, shape, dtype):
        bench = _require_decode()
        self.shape = bench.parse_shape(shape)
        common.warm_up(lambda: bench.measure((1, 2, 1, 1, 64, 8), dtype, rounds=1, calls=1,
                                             threads=1, with_torch=False))

    def _row(self, dtype, with_torch):
        from elastic_np import cpu

        bench = _require_decode()
        rounds = max(common.TRACK_REPEAT, 1)
        times, nbytes = bench.measure(self.shape, dtype, rounds=rounds, calls=3,
                                      threads=cpu.thread_count(), with_torch=with_torch)
        return bench.summarise(self.shape, times, nbytes)

    def track_fraction_of_streaming_read(self, shape, dtype):
        return self._row(dtype, with_torch=False)["fraction_of_read"]["median"]

    track_fraction_of_streaming_read.unit = "cache bytes/s over streaming read"

    def track_speedup_over_torch(self, shape, dtype):
        common.require_torch()
        return self._row(dtype, with_torch=True)["torch_over_ours"]["median"]

    track_speedup_over_torch.unit = "torch time / ours"
