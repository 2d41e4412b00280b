"""Time forward + backward with the SIMT and the tensor-core backward side by side on a GPU, with torch.

``B=4, H=16, N=M=4096``: D = 64 and D = 128 causal. Per dtype, in
interleaved rounds in one process: elastic_np's forward and backward as
configured by default (``TC_BACKWARD`` off: a SIMT backward), the same with
the tensor-core backward (`elastic_np.cuda._tensor_core.backward`; for float32 also
the forward as 3xTF32, ``TC_FLOAT32``), and torch's
``scaled_dot_product_attention`` forward and backward in the same dtype.
The switches are read at launch (`elastic_np.cuda._runtime.config`), so one process
times them all. Also the largest difference of the gradients between the
two elastic_np runs, relative to their magnitude. Prints medians and ranges
and writes them to a JSON file (first argument).
"""

import json
import sys
import time

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench
from elastic_np.cuda._runtime import config as _config


def _ours(q, k, v, dout, causal, tensor_cores):
    from numba import cuda

    def run():
        _config.TC_BACKWARD = tensor_cores
        _config.TC_FLOAT32 = tensor_cores  # the float32 forward as 3xTF32 too (float64's is on the tensor cores)
        out, lse = enp.attention(q, k, v, causal=causal, return_lse=True, backend="cuda")
        grads = enp.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cuda")
        cuda.synchronize()
        return grads

    return run


def _host(x):
    """A device array (numba's or torch's) as a float64 NumPy array."""
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    elif hasattr(x, "cpu"):
        x = x.cpu().numpy()
    return np.asarray(x, dtype=np.float64)


#: ``((B, H, N, D), causal)`` of each case: issue 45's shapes.
SHAPES = [((4, 16, 4096, 64), False), ((4, 16, 4096, 128), True)]


def main(path, rounds=5, shapes=SHAPES):
    import torch

    results = []
    for (B, H, N, D), causal in shapes:
        for dtype in ("float32", "float64"):
            q, k, v = (torch.from_numpy(a).cuda() for a in _bench.make_inputs(B, H, N, N, D, dtype=dtype))
            dout = torch.randn_like(q)
            runs = {"simt backward": _ours(q, k, v, dout, causal, False),
                    "tensor-core backward": _ours(q, k, v, dout, causal, True)}

            def theirs():
                _bench.torch_sdpa(q, k, v, causal=causal, backward=True, dout=dout)
                torch.cuda.synchronize()

            runs["torch"] = theirs
            grads = {name: fn() for name, fn in runs.items() if name != "torch"}  # compiles
            theirs()
            gaps = {}
            for name in ("dq", "dk", "dv"):
                tc, simt = (_host(getattr(grads[run], name)) for run in ("tensor-core backward", "simt backward"))
                gaps[name] = float(np.abs(tc - simt).max() / np.abs(simt).max())
            print(f"{dtype} D={D} causal={causal}: tensor-core vs SIMT gradients, max relative gap {gaps}", flush=True)
            times = {name: [] for name in runs}
            for r in range(rounds):
                for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                    start = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - start)
            flops = _bench.attention_flops(B, H, N, N, D, causal=causal, backward=True)
            for name, ts in times.items():
                med = float(np.median(ts))
                entry = {"shape": [B, H, N, D], "causal": causal, "dtype": dtype, "run": name,
                         "pass": "forward+backward", "median_s": med, "min_s": float(min(ts)),
                         "max_s": float(max(ts)), "tflops": flops / med / 1e12,
                         "torch_over_this": float(np.median(times["torch"])) / med, "gradient_gaps": gaps}
                results.append(entry)
                print(f"{dtype} D={D} causal={causal} {name:22s} {med * 1e3:9.3f} ms "
                      f"[{min(ts) * 1e3:.3f}, {max(ts) * 1e3:.3f}] {entry['tflops']:7.2f} TFLOP/s "
                      f"torch/this {entry['torch_over_this']:.2f}", flush=True)
    _config.TC_BACKWARD = False
    _config.TC_FLOAT32 = False
    with open(path, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda_backward_variants.json")
