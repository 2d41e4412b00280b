"""Time the tensor-core forward's tile choices side by side on a GPU (float32 and float64).

Forward only, ``B=4, H=16, N=M=4096``: D = 64 and D = 128 causal, each
configuration (keys per tile, warps per block, precision; the float32
default as 3xTF32, ``TC_FLOAT32``) in interleaved rounds with torch SDPA in
the same dtype; prints medians and ranges and
writes them to a JSON file (first argument). The tile sizes are read at
launch (`elastic_np.cuda._runtime.config`), so one process times them all.
"""

import json
import sys
import time

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench
from elastic_np.cuda._runtime import config as _config


def main(path):
    import torch
    from numba import cuda

    shapes = [((4, 16, 4096, 64), False), ((4, 16, 4096, 128), True)]
    _config.TC_FLOAT32 = True  # the float32 default on the tensor cores too (3xTF32)
    variants = [("float32", keys, warps, precision) for keys, warps in ((32, 8), (64, 8), (32, 4))
                for precision in (None, "tf32")]
    variants += [("float64", 32, warps, None) for warps in (4, 8)]
    results = []
    for (B, H, N, D), causal in shapes:
        for dtype in ("float32", "float64"):
            q, k, v = (torch.from_numpy(a).cuda() for a in _bench.make_inputs(B, H, N, N, D, dtype=dtype))
            runs = {}
            for vdtype, keys, warps, precision in variants:
                if vdtype != dtype:
                    continue

                def ours(keys=keys, warps=warps, precision=precision):
                    _config.TC_KEYS[np.dtype(dtype).itemsize] = keys
                    _config.TC_FORWARD_WARPS = warps
                    extra = {} if precision is None else {"precision": precision}
                    enp.attention(q, k, v, causal=causal, return_lse=True, backend="cuda", **extra)
                    cuda.synchronize()

                runs[f"k{keys} w{warps} {precision or 'default'}"] = ours

            def theirs():
                with torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.cuda.synchronize()

            runs["torch"] = theirs
            times = {name: [] for name in runs}
            for fn in runs.values():
                fn()  # compiles
            for _ in range(5):
                for name, fn in runs.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            flops = _bench.attention_flops(B, H, N, N, D, causal=causal)
            for name, ts in times.items():
                med = float(np.median(ts))
                entry = {"shape": [B, H, N, D], "causal": causal, "dtype": dtype, "run": name,
                         "median_s": med, "min_s": float(min(ts)), "max_s": float(max(ts)),
                         "tflops": flops / med / 1e12,
                         "torch_over_this": float(np.median(times["torch"])) / med}
                results.append(entry)
                print(f"{dtype} D={D} causal={causal} {name:24s} {med * 1e3:8.3f} ms "
                      f"[{min(ts) * 1e3:.3f}, {max(ts) * 1e3:.3f}] {entry['tflops']:7.2f} TFLOP/s "
                      f"torch/this {entry['torch_over_this']:.2f}", flush=True)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda_forward_variants.json")
