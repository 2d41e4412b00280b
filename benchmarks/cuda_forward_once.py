"""One configuration of the tensor-core forward, timed: for a profiler (ncu) or a side-by-side of builds.

``python benchmarks/cuda_forward_once.py DTYPE PRECISION KEYS WARPS [ordered]``
times the forward at ``B=4, H=16, N=M=4096, D=64`` (median of 10 after a
warm-up) and prints it; ``ordered`` compiles the products as volatile
assembly, in their written order (`elastic_np.cuda._tensor_core.mma._ORDERED`; give the
process a cache directory of its own, ``NUMBA_CACHE_DIR``).
"""

import sys
import time

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench
from elastic_np.cuda._runtime import config as _config
from elastic_np.cuda._tensor_core import mma as _mma


def main(dtype, precision, keys, warps, ordered=False):
    import torch
    from numba import cuda

    _mma._ORDERED = ordered
    _config.TC_FLOAT32 = True
    _config.TC_KEYS[np.dtype(dtype).itemsize] = keys
    _config.TC_FORWARD_WARPS = warps
    extra = {} if precision == "default" else {"precision": precision}
    B, H, N, D = 4, 16, 4096, 64
    q, k, v = (torch.from_numpy(a).cuda() for a in _bench.make_inputs(B, H, N, N, D, dtype=dtype))
    enp.attention(q, k, v, backend="cuda", **extra)
    cuda.synchronize()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        enp.attention(q, k, v, backend="cuda", **extra)
        cuda.synchronize()
        times.append(time.perf_counter() - start)
    med = float(np.median(times))
    flops = _bench.attention_flops(B, H, N, N, D)
    print(f"{dtype} {precision} k{keys} w{warps} {'ordered' if ordered else 'unordered'}: {med * 1e3:.3f} ms "
          f"[{min(times) * 1e3:.3f}, {max(times) * 1e3:.3f}] {flops / med / 1e12:.2f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), len(sys.argv) > 5 and sys.argv[5] == "ordered")
