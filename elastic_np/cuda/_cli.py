"""``python -m elastic_np.cuda``: PTX check, resource report and GPU benchmark."""

import argparse

from elastic_np._errors import BackendUnavailableError
from elastic_np.cuda import _bench
from elastic_np.cuda._compile import _print_resources, ptx


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
    parser.add_argument("--json", metavar="FILE", help="with --bench: also time the decode shapes, write all to FILE")
    parser.add_argument("--resources", nargs="*", metavar="CC",
                        help="registers, local memory, spills and shared memory of every kernel (no GPU needed)")
    args = parser.parse_args(argv)
    if args.json is not None and not args.bench:
        parser.error("--json needs --bench")
    if args.resources is not None:
        _print_resources(args.resources or ["8.0", "9.0"])
    if args.ptx is not None:
        for cc in args.ptx or ["8.0", "9.0"]:
            major, minor = (int(part) for part in cc.split("."))
            code = ptx(cc=(major, minor))
            for name, text in code.items():
                if ".entry" not in text:
                    raise SystemExit(f"{name}: no kernel entry in the PTX for sm_{major}{minor}")
                print(f"sm_{major}{minor}  {name:32s} {len(text):8d} chars of PTX")
    if args.bench:
        try:
            _bench.run(tuple(args.shape), causal=args.causal, softcap=args.softcap, alibi=args.alibi,
                       bias=args.bias, json_path=args.json)
        except BackendUnavailableError as exc:
            raise SystemExit(f"python -m elastic_np.cuda --bench: {exc}") from None
