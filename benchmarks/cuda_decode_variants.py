"""Time the CUDA decode's split choices side by side on a GPU, and show where a call's host time goes.

Decoding shape ``B=1, H=32, Hkv=8, N=1, M=8192, D=128`` float32 (issue 45's),
each setting (``DECODE_MIN_BLOCKS``, ``DECODE_MIN_SPLIT_KEYS`` and
``DECODE_MAX_SHARED_BYTES`` of `elastic_np.cuda._runtime.config`, read at launch, so
one process times them all; the 48 KB cap gives half the lanes a row)
against torch SDPA in interleaved rounds: the call (best of 20, synchronised),
our kernels alone (`elastic_np.cli._cuda_bench.kernel_seconds`, CUPTI
through torch's profiler), the K/V read rate against a device-to-device
copy's. Then a cProfile of 100 calls with the defaults, by cumulative time. Writes the
medians to a JSON file (first argument).
"""

import cProfile
import io
import json
import pstats
import sys

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench, _cuda_bench
from elastic_np.cuda._runtime import config as _config

#: (DECODE_MIN_BLOCKS, DECODE_MIN_SPLIT_KEYS, DECODE_MAX_SHARED_BYTES), the defaults first
VARIANTS = ((512, 128, 48 * 1024), (256, 256, 48 * 1024), (1024, 64, 48 * 1024), (2048, 32, 48 * 1024),
            (256, 256, None), (512, 128, None))


def main(path, rounds=3):
    import torch

    B, H, Hkv, N, M, D = 1, 32, 8, 1, 8192, 128
    q, k, v = (torch.from_numpy(a).cuda() for a in _bench.make_inputs(B, H, N, M, D, Hkv=Hkv, dtype=np.float32))
    kv_bytes = 2 * B * Hkv * M * D * 4
    copy = _cuda_bench.copy_bandwidth()

    def ours():
        enp.attention(q, k, v, causal=True, return_lse=True, backend="cuda")
        torch.cuda.synchronize()

    def theirs():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()

    rows = {variant: {"call": [], "kernels": []} for variant in VARIANTS}
    torch_times = []
    for _ in range(rounds):
        for variant in VARIANTS:
            _config.DECODE_MIN_BLOCKS, _config.DECODE_MIN_SPLIT_KEYS, _config.DECODE_MAX_SHARED_BYTES = variant
            ours()
            rows[variant]["call"].append(_bench.best_time(ours, repeat=20))
            rows[variant]["kernels"].append(_cuda_bench.kernel_seconds(torch, ours))
        theirs()
        torch_times.append(_bench.best_time(theirs, repeat=20))
    _config.DECODE_MIN_BLOCKS, _config.DECODE_MIN_SPLIT_KEYS, _config.DECODE_MAX_SHARED_BYTES = VARIANTS[0]
    out = torch.as_tensor(enp.attention(q, k, v, causal=True, backend="cuda"), device="cuda")
    error = float((out - torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)).abs().max())
    t_torch = float(np.median(torch_times))
    print(f"device-to-device copy: {copy / 1e9:.0f} GB/s (read + written); max |ours - torch| = {error:.2e}")
    print(f"{'blocks, keys, shared':<22}{'call (ms)':>10}{'kernels (ms)':>13}{'K/V GB/s':>10}{'of copy':>9}"
          f"{'torch / call':>13}")
    results = []
    for variant, r in rows.items():
        call, kernels = float(np.median(r["call"])), float(np.median(r["kernels"]))
        rate = kv_bytes / kernels
        print(f"{str(variant):<22}{call * 1e3:>10.3f}{kernels * 1e3:>13.4f}{rate / 1e9:>10.0f}{rate / copy:>9.0%}"
              f"{t_torch / call:>13.2f}")
        results.append({"variant": variant, "call": r["call"], "kernels": r["kernels"]})
    print(f"torch SDPA: {t_torch * 1e3:.3f} ms")
    with open(path, "w") as f:
        json.dump({"copy_bandwidth": copy, "torch": torch_times, "variants": results, "max_abs_error": error}, f,
                  indent=1)
    _config.DECODE_MIN_BLOCKS, _config.DECODE_MIN_SPLIT_KEYS, _config.DECODE_MAX_SHARED_BYTES = VARIANTS[0]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        enp.attention(q, k, v, causal=True, return_lse=True, backend="cuda")
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    print(text.getvalue())


if __name__ == "__main__":
    main(sys.argv[1])
