"""``python -m elastic_np.cuda``: PTX check, resource report and GPU benchmark.

The command of the CUDA backend's compile-only functions (`elastic_np.cuda.ptx`,
`elastic_np.cuda.resources`, `elastic_np.cuda.dynamic_shared_bytes`) and of the
GPU benchmark (`elastic_np.cli._cuda_bench`); ``elastic_np/cuda/__main__.py``
forwards to `main`.
"""

import argparse

import numpy as np

from elastic_np import cuda
from elastic_np._contract._errors import BackendUnavailableError
from elastic_np.cli import _cuda_bench as _bench


def _print_resources(ccs):
    """Print `elastic_np.cuda.resources` for each capability, and the dynamic shared memory at D = 64 and 128."""
    for cc in ccs:
        major, minor = (int(part) for part in cc.split("."))
        for name, entry in cuda.resources(cc=(major, minor)).items():
            spill = (f"SPILLS {entry['spill_store_bytes']} B stored, {entry['spill_load_bytes']} B loaded"
                     if entry["spills"] else "no spills")
            print(f"sm_{major}{minor}  {name:32s} {entry['registers']:4d} registers  "
                  f"{entry['stack_bytes']:5d} B stack  {entry['static_shared_bytes']:5d} B static shared  {spill}")
    for dtype in cuda.dtypes:
        for D in (64, 128):
            for name, (threads, tile, size) in cuda.dynamic_shared_bytes(D, D, np.dtype(dtype)).items():
                print(f"{dtype} D=Dv={D}  {name:24s} {threads:4d} threads  tile {tile:3d}  {size:6d} B dynamic shared")


def _print_ptx(ccs):
    """Compile every kernel to PTX for each capability (`elastic_np.cuda.ptx`) and print the sizes."""
    for cc in ccs:
        major, minor = (int(part) for part in cc.split("."))
        code = cuda.ptx(cc=(major, minor))
        for name, text in code.items():
            if ".entry" not in text:
                raise SystemExit(f"{name}: no kernel entry in the PTX for sm_{major}{minor}")
            print(f"sm_{major}{minor}  {name:32s} {len(text):8d} chars of PTX")


def main(argv=None):
    """Run ``python -m elastic_np.cuda`` with ``argv`` (default: this process's arguments)."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_np.cuda", description="CUDA backend: PTX check and GPU benchmark"
    )
    parser.add_argument("--ptx", nargs="*", metavar="CC", help="compile every kernel for these capabilities (e.g. 8.0 9.0)")
    parser.add_argument("--bench", action="store_true", help="time against torch SDPA on the GPU (float32)")
    parser.add_argument("--shape", nargs=4, type=int, default=_bench.DEFAULT_SHAPE, metavar=("B", "H", "N", "D"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--softcap", type=float, default=None, help="time with this soft-cap of the scores")
    parser.add_argument("--alibi", action="store_true", help="time with ALiBi (geometric slopes)")
    parser.add_argument("--bias", choices=sorted(_bench.BENCH_BIAS_SHAPES), default=None,
                        help="time with a bias of this shape")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="with --bench: the dtype of the training shape (torch SDPA in it too)")
    parser.add_argument("--precision", choices=("tf32",), default=None,
                        help="with --bench: float32 products as one TF32 product on the tensor cores")
    parser.add_argument("--json", metavar="FILE",
                        help="with --bench: also time TF32, float64, D = 128 causal and the decode shapes, "
                             "write all to FILE")
    parser.add_argument("--resources", nargs="*", metavar="CC",
                        help="registers, local memory, spills and shared memory of every kernel (no GPU needed)")
    args = parser.parse_args(argv)
    if args.json is not None and not args.bench:
        parser.error("--json needs --bench")
    if args.resources is not None:
        _print_resources(args.resources or ["8.0", "9.0"])
    if args.ptx is not None:
        _print_ptx(args.ptx or ["8.0", "9.0"])
    if args.bench:
        try:
            _bench.run(tuple(args.shape), causal=args.causal, softcap=args.softcap, alibi=args.alibi,
                       bias=args.bias, json_path=args.json, dtype=args.dtype, precision=args.precision)
        except BackendUnavailableError as exc:
            raise SystemExit(f"python -m elastic_np.cuda --bench: {exc}") from None
