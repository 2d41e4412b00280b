"""The ``elastic-np`` command-line tool.

Subcommands:

- ``elastic-np check [--backend cpu|cuda|reference|all] [--quick]``: the
  conformance battery of each backend against the float64 oracles, and the
  oracles' gradients against finite differences; exit code 1 on any failure.
- ``elastic-np bench [--quick] [--seq N ...] [--heads H] [--dim D] [--dtype ...]
  [--plot FILE.png] [--json FILE]``: side-by-side timings.
- ``elastic-np bench --decode [--quick] [--shape B,H,Hkv,N,M,D ...] [--dtype ...]
  [--rounds R] [--json FILE]``: decoding against a KV cache, beside torch SDPA
  and a streaming read of the cache's bytes.
- ``elastic-np bench --gpu [--quick] [--batch B] [--heads H] [--seq N] [--dim D]
  [--causal] [--softcap X] [--alibi] [--bias SHAPE] [--dtype T] [--precision tf32]
  [--repeat R] [--json FILE]``: the CUDA kernels against torch SDPA on one GPU,
  float32 unless told (what ``python -m elastic_np.cuda --bench`` runs;
  `elastic_np.cli._cuda_bench.run`).
- ``elastic-np warmup [--dtype ...] [--options NAME ...] [--backend ...] [--second-order] [--caches FORMAT ...]``:
  compile (or load from the cache) the kernels ahead of the first call.
- ``elastic-np example`` (also with no subcommand): a worked example.

Bad arguments give a one-line error and exit code 2.

This package holds the tools and uses the library as a user would: the
benchmarks (``_bench``, ``_bench_decode``, ``_cuda_bench``), the progress bar
(``_progress``), the first compile before ``check`` (``_first_compile``) and
``python -m elastic_np.cuda`` (``_cuda``). No backend imports it.
"""

import argparse
import json
import sys
import warnings

import numpy as np

from elastic_np import reference, testing
from elastic_np._api import compile_report, dispatch
from elastic_np._contract import _spec, _validation
from elastic_np._api.warmup import warmup
from elastic_np._contract._errors import BackendUnavailableError, CompileWarning
from elastic_np.cli import _bench, _bench_decode
from elastic_np.cli import _cuda_bench as cuda_bench
from elastic_np.cli._progress import Progress, first_call_line
from elastic_np.testing._battery import check_oracle_gradients, run_battery
from elastic_np.testing._cases import (
    CAPABILITIES, CASES, OPTION_NAMES, VARIANT_NAMES, case_dtypes, select_cases, variant_cases,
)


def _example(args):
    """Evaluate the oracles on a small worked example and print the results."""
    with np.printoptions(precision=6, suppress=True):
        x = np.array([-1.0, 0.0, 1.0, 2.0])
        print("logits x                         ", x)
        print("softmax(x)                       ", reference.softmax(x))
        print("online_softmax(x, block_size=3)  ", reference.online_softmax(x, block_size=3))
        print("nvm(x)                           ", reference.nvm(x))
        print("elastic_softmax(x, tau=0.5, beta=1)", reference.elastic_softmax(x, tau=0.5, beta=1.0))
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
        out, lse = reference.attention(q, k, v, causal=True, nvm=True, tau=0.5, beta=1.0)
        print("attention(causal, nvm, tau=0.5, beta=1): out[0, 0, :, :3] =")
        print(out[0, 0, :, :3])
        print("lse[0, 0] =", lse[0, 0])
    return 0


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _usage_error(command, message):
    print(f"elastic-np {command}: error: {message}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------
# warmup
# ---------------------------------------------------------------------------


def _warmup(args):
    """`elastic_np.warmup` with the command's arguments; a line per kernel path and what compiled."""
    try:
        report = warmup(dtypes=args.dtype, options=args.options, backend=args.backend,
                        second_order=args.second_order, caches=args.caches or ())
    except (ValueError, BackendUnavailableError) as exc:
        return _usage_error("warmup", str(exc))
    for (dtype, path), seconds in report.seconds.items():
        print(f"  {dtype:<8} {path:<20} {seconds:6.2f} s")
    if report.compiled:
        print(f"compiled {report.compiled} functions, saved to Numba's cache: later processes load them")
    else:
        print("nothing compiled: every kernel came from Numba's cache (or was already loaded)")
    return 0


# ---------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------

_KERNEL_BACKENDS = ("cpu", "cuda")
#: The dtypes ``check`` and ``warmup`` take.
_DTYPES = ("float32", "float64", *_validation.HALF_DTYPES)


def _compile(name, dtypes, progress):
    """The first calls of every specialisation the battery uses in ``dtypes`` (`elastic_np.cli._first_compile`).

    Says before them that they compile or load from Numba's cache, while they
    run what runs, and after them which it was. Returns their
    `elastic_np._api.compile_report.Watch`, with the functions a second process compiled.
    """
    # imported here: the module also runs as a script in the child process (python -m), which
    # runpy would find already imported by this package
    from elastic_np.cli._first_compile import compile_backend

    names = ", ".join(np.dtype(d).name for d in dtypes)
    progress.begin(f"{name}: first call of the kernels ({names}): compiling, or loading from Numba's cache")
    with compile_report.watch() as seen:
        child = compile_backend(name, dtypes, step=progress.doing)
    seen.compiled = seen.compiled | (child or frozenset())
    line = first_call_line(name, seen)
    if child is None:
        later = ", ".join(np.dtype(d).name for d in dtypes[1:])
        line += f"; the second process failed: {later} compiles on its first call in the battery"
    progress.stage(line)
    return seen


def _check(args):
    modules, skipped, error = _check_backends(args.backend)
    if error is not None:
        return _usage_error("check", error)
    reports, first_calls = _run_checks(modules, args)
    for report in reports:
        print(report)
        print()
    for name, seen in first_calls.items():
        print(f"backend {name!r}: first calls took {seen.summary()}")
    for name, reason in skipped.items():
        print(f"backend {name!r}: skipped ({reason})")
    return _check_verdict(reports, modules, skipped)


def _check_backends(choice):
    """``(modules, skipped, error)``: the backends to check, those skipped with why, or the error of one asked for."""
    requested = _KERNEL_BACKENDS if choice == "all" else (choice,)
    modules, skipped = {}, {}
    for name in requested:
        try:
            modules[name] = dispatch.get_backend(name)
        except Exception as exc:  # a missing package or device, whatever its error type
            reason = str(exc) if isinstance(exc, BackendUnavailableError) else (
                f"backend {name!r} is not available: {type(exc).__name__}: {exc}")
            if choice != "all":
                return {}, {}, reason
            skipped[name] = reason
    return modules, skipped, None


def _run_checks(modules, args):
    """The battery of each backend (after its first calls) and the oracles' gradients: reports, first calls' `Watch`."""
    dtypes = [_validation.numpy_dtype(d) for d in args.dtype]
    backend_dtypes = {name: [d for d in dtypes if module.dtypes is None or d.name in module.dtypes]
                      for name, module in modules.items()}
    cases = variant_cases(args.variants)
    steps = sum(len(case_dtypes(case, backend_dtypes[name])) for name in modules
                for case in select_cases(_supported(name, modules[name]), cases)[0])
    steps += sum(c.oracle_gradients for c in CASES)
    reports, first_calls = [], {}
    with Progress(steps, "elastic-np check", delay=args.progress_delay) as progress:
        for name, module in modules.items():
            supported, backend_dtypes = _supported(name, module), backend_dtypes[name]
            if name != "reference":
                try:
                    first_calls[name] = _compile(name, backend_dtypes, progress)
                except Exception as exc:  # the battery below reports each failing case
                    progress.stage(f"{name}: the first call failed: {type(exc).__name__}: {exc}")
            fn, backward = testing.backend_functions(name)
            reports.append(run_battery(
                fn, backward=backward, supported=supported, dtypes=backend_dtypes,
                quick=args.quick, seed=args.seed, title=f"backend {name!r} vs the float64 oracle",
                progress=progress.update, cases=cases,
            ))
        reports.append(check_oracle_gradients(
            quick=args.quick, seed=args.seed, progress=progress.update))
    return reports, first_calls


def _supported(backend, module):
    """The options (of the kit's, `OPTION_NAMES`) ``backend`` takes, the arguments of a user's variant where its
    ``module`` takes them, and the capabilities."""
    taken = _spec.taken_by(backend)
    variants = VARIANT_NAMES if getattr(module, "takes_variants", False) else ()
    return tuple(name for name in OPTION_NAMES if name in taken) + variants + CAPABILITIES


def _check_verdict(reports, modules, skipped):
    """Print PASS or FAIL with the counts; the exit code."""
    rows = [row for report in reports for row in report.rows]
    failed = [row for row in rows if not row.passed]
    checked = ", ".join(modules) or "none"
    if failed:
        cases = sorted({f"{row.case} ({row.dtype})" for row in failed})
        print(f"FAIL: {len(failed)} of {len(rows)} checks failed (backends checked: {checked}); "
              f"failing cases: {', '.join(cases)}")
        return 1
    print(f"PASS: {len(rows)} checks passed (backends checked: {checked}"
          + (f"; skipped: {', '.join(skipped)}" if skipped else "") + ")")
    return 0


# ---------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------


def _bench_command(args):
    """``elastic-np bench``: the GPU, decode or prefill benchmark, after the checks of their flags."""
    if args.gpu:
        kind, error = _bench_gpu, _gpu_usage_error(args)
    elif args.decode:
        kind, error = _bench_decoding, _decode_usage_error(args) or _dtype_usage_error(args)
    else:
        kind, error = _bench_prefill, _prefill_usage_error(args) or _dtype_usage_error(args)
    if error is not None:
        return _usage_error("bench", error)
    return kind(args)


def _dtype_usage_error(args):
    """The error of a ``--dtype`` this installation cannot make (bfloat16 without ml_dtypes), or None."""
    try:
        _validation.numpy_dtype(args.dtype)
    except TypeError as exc:
        return f"argument --dtype: {exc}"
    return None


def _first_flag_given(flags):
    """The first of ``{flag: value}`` whose value is not None, else None."""
    return next((flag for flag, value in flags.items() if value is not None), None)


def _gpu_only_flags(args):
    return {"--softcap": args.softcap, "--alibi": args.alibi or None, "--bias": args.bias,
            "--precision": args.precision}


def _prefill_usage_error(args):
    """What is wrong with the flags of the prefill benchmark, or None."""
    gpu_only = _first_flag_given(_gpu_only_flags(args))
    decode_only = _first_flag_given({"--shape": args.shape, "--rounds": args.rounds})
    if gpu_only is not None:
        return f"argument {gpu_only}: only with --gpu"
    if decode_only is not None:
        return f"argument {decode_only}: only with --decode"
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install 'elastic_np[bench]'"
    if args.min_time is not None and not args.min_time >= 0:
        return f"argument --min-time: expected seconds >= 0, got {args.min_time}"
    return None


def _prefill_sizes(args):
    """``(seqs, heads, dim, repeat, min_time, matmul_n)``: the flags, else the defaults of the mode."""
    if args.quick:
        seqs, heads, dim, min_time, matmul_n = args.seq or [64, 128], args.heads or 2, args.dim or 32, 0.05, 1024
    else:
        seqs, heads, dim, min_time, matmul_n = (args.seq or [256, 512, 1024, 2048], args.heads or 8,
                                                args.dim or 64, 0.5, 2048)
    if args.min_time is not None:
        min_time = args.min_time
    return seqs, heads, dim, args.repeat or 5, min_time, matmul_n


def _threads(args):
    """``--threads``, else 1 with ``--quick`` and the kernels' count (all cores by default) without."""
    if args.threads is not None:
        return args.threads
    return 1 if args.quick else _bench.thread_count()


def _bench_prefill(args):
    seqs, heads, dim, repeat, min_time, matmul_n = _prefill_sizes(args)
    impls = _bench.implementations(args.causal)
    available = sum(not isinstance(fns, str) for fns in impls.values())
    with Progress(len(seqs) * available * len(_bench.PASSES), "elastic-np bench",
                  delay=args.progress_delay) as progress:
        def notify(kind, message):
            {"start": progress.begin, "stage": progress.stage}.get(kind, progress.update)(message)

        comparison = _bench.compare(
            seqs, batch=args.batch or 1, heads=heads, dim=dim, dtype=args.dtype,
            causal=args.causal, repeat=repeat, min_time=min_time, matmul_n=matmul_n, impls=impls,
            progress=notify, threads=_threads(args),
        )
    print(_bench.format_table(comparison))
    _write_results(args, comparison)
    if args.plot is not None:
        _bench.plot(comparison, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _write_results(args, result):
    """With ``--json FILE``: the machine, the command line and ``result`` to ``FILE``."""
    if args.json is None:
        return
    record = {"machine": _bench.machine_info(), "command": " ".join(["elastic-np", *args.argv]), **result}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    print(f"results written to {args.json}")


def _decode_usage_error(args):
    """What is wrong with the flags of the decode benchmark, or None."""
    gpu_only = _first_flag_given(_gpu_only_flags(args))
    if gpu_only is not None:
        return f"argument {gpu_only}: only with --gpu"
    prefill_only = _first_flag_given({
        "--seq": args.seq, "--heads": args.heads, "--dim": args.dim, "--batch": args.batch,
        "--causal": args.causal or None, "--repeat": args.repeat, "--min-time": args.min_time, "--plot": args.plot})
    if prefill_only is not None:
        return f"argument {prefill_only}: not with --decode (decode shapes are given by --shape)"
    try:
        for shape in args.shape or ():
            _bench_decode.parse_shape(shape)
    except ValueError as exc:
        return f"argument --shape: {exc}"
    return None


def _bench_decoding(args):
    shapes = [_bench_decode.parse_shape(s) for s in args.shape] if args.shape else (
        _bench_decode.QUICK_SHAPES if args.quick else _bench_decode.SHAPES)
    try:
        dispatch.get_backend("cpu")
    except BackendUnavailableError as exc:
        print(f"elastic-np bench --decode: the cpu backend is unavailable: {exc}", file=sys.stderr)
        return 1
    rounds = args.rounds or (3 if args.quick else 7)
    with Progress(len(shapes), "elastic-np bench --decode", delay=args.progress_delay) as progress:
        result = _bench_decode.compare(
            shapes, args.dtype, rounds=rounds, calls=1 if args.quick else 3, threads=_threads(args),
            progress=lambda shape: progress.update(",".join(map(str, shape)) + " done"))
    print(_bench_decode.format_table(result))
    _write_results(args, result)
    return 0


def _gpu_usage_error(args):
    """What is wrong with the flags of the GPU benchmark, or None."""
    not_gpu = _first_flag_given({"--decode": args.decode or None, "--shape": args.shape, "--rounds": args.rounds,
                                 "--plot": args.plot, "--min-time": args.min_time,
                                 "--threads": args.threads})
    if not_gpu is not None:
        return f"argument {not_gpu}: not with --gpu"
    if args.dtype in _validation.HALF_DTYPES:
        return (f"argument --dtype: --gpu times float32 or float64 (the CUDA kernels take neither half), "
                f"got {args.dtype}")
    if args.precision is not None and args.dtype != "float32":
        return f"argument --precision: TF32 applies to float32, got --dtype {args.dtype}"
    if args.seq is not None and len(args.seq) != 1:
        return "argument --seq: --gpu times one sequence length"
    if args.softcap is not None and not args.softcap > 0:
        return f"argument --softcap: expected a number > 0, got {args.softcap}"
    return None


def _bench_gpu(args):
    B, H, N, D = _GPU_QUICK_SHAPE if args.quick else cuda_bench.DEFAULT_SHAPE
    shape = (args.batch or B, args.heads or H, args.seq[0] if args.seq else N, args.dim or D)
    try:
        cuda_bench.run(shape, causal=args.causal, softcap=args.softcap, alibi=args.alibi, bias=args.bias,
                       repeat=args.repeat or (3 if args.quick else None), json_path=args.json,
                       command=" ".join(["elastic-np", *args.argv]), dtype=args.dtype, precision=args.precision)
    except BackendUnavailableError as exc:
        print(f"elastic-np bench --gpu: {exc}", file=sys.stderr)
        return 1
    return 0


#: ``elastic-np bench --gpu --quick``: ``(B, H, N, D)``, and 3 timed runs.
_GPU_QUICK_SHAPE = (1, 4, 1024, 64)


def build_parser():
    parser = _Parser(
        prog="elastic-np",
        description="Float64 oracles and fast kernels for Elastic-Softmax attention.",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _subcommand(sub, "example", _example, "evaluate the oracles on a worked example")
    _add_warmup(sub)
    for p in (_add_check(sub), _add_bench(sub)):
        p.add_argument("--progress-delay", type=float, default=2.0, help=argparse.SUPPRESS)
    return parser


def _subcommand(sub, name, func, summary, description=None):
    """The parser of ``elastic-np name``, which runs ``func(args)``; ``summary`` is its line in the list of commands."""
    parser = sub.add_parser(name, help=summary, description=description)
    parser.set_defaults(func=func)
    return parser


def _add_dtypes(parser, help):
    """``--dtype`` with any of `_DTYPES`, float32 and float64 by default."""
    parser.add_argument("--dtype", nargs="+", choices=_DTYPES, default=["float32", "float64"],
                        help=f"{help} (default: float32 and float64)")


def _add_warmup(sub):
    warm = _subcommand(
        sub, "warmup", _warmup,
        "compile the kernels ahead of the first call (for a Docker build or a worker's start)",
        "Compile, or load from Numba's on-disk cache, every kernel that later calls of "
        "the given dtypes and options will run (elastic_np.warmup): run it where "
        "waiting is cheap, such as a Docker image's build, so that the first call "
        "of a training loop or a server does not compile.",
    )
    _add_dtypes(warm, "dtypes of the later calls")
    warm.add_argument("--options", nargs="+", metavar="NAME",
                      help="names of the options the later calls use (default: every option)")
    warm.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                      help="backend to warm up (default: auto, as attention picks it)")
    warm.add_argument("--second-order", action="store_true",
                      help="also compile the double backward (second derivatives)")
    warm.add_argument("--caches", nargs="+", metavar="FORMAT", choices=("int8", "float8_e4m3fn", "float8_e5m2"),
                      help="also compile the forwards of quantized caches of these formats (int8, float8_e4m3fn, "
                           "float8_e5m2) for the float32 and half dtypes")
    return warm


def _add_check(sub):
    check = _subcommand(
        sub, "check", _check, "check the backends against the float64 oracles",
        "Run the conformance battery (every option alone and combined, forward "
        "and every gradient) of each backend against the float64 oracles, and "
        "the oracles' gradients against finite differences. Exit code 1 on any "
        "failure.",
    )
    check.add_argument("--backend", choices=("cpu", "cuda", "reference", "all"), default="all",
                       help="backend to check; 'all' (default) checks every available kernel "
                            "backend and reports the others as skipped; 'reference' checks "
                            "the float64 backend itself")
    check.add_argument("--quick", action="store_true", help="tiny sizes (well under a minute)")
    _add_dtypes(check, "dtypes to check (bfloat16 needs ml_dtypes; the CUDA kernels take neither half)")
    check.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    check.add_argument("--variants", action="store_true",
                       help="also the cases of a user's variant (a score_mod with a learnable bias table, a "
                            "document mask as a mask_mod and as a block mask) where the backend takes them; "
                            "their kernels compile per function and are not cached: seconds more per dtype")
    return check


def _add_bench(sub):
    bench = _subcommand(
        sub, "bench", _bench_command, "time the kernels against naive NumPy and PyTorch",
        "Side-by-side time, GFLOP/s, fraction of the matrix-multiply peak and "
        "peak memory of the elastic_np kernels, naive NumPy attention and "
        "torch's scaled_dot_product_attention, forward and forward+backward.",
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    bench.add_argument("--seq", type=_positive_int, nargs="+", metavar="N",
                       help="sequence lengths (N = M)")
    bench.add_argument("--heads", type=_positive_int, help="number of heads H")
    bench.add_argument("--dim", type=_positive_int, help="head dimension D")
    bench.add_argument("--batch", type=_positive_int, help="batch size B (default 1)")
    bench.add_argument("--dtype", choices=_DTYPES, default="float32",
                       help="dtype of the inputs (default float32; bfloat16 needs ml_dtypes; "
                            "--gpu takes float32 and float64)")
    bench.add_argument("--causal", action="store_true", help="causal attention")
    bench.add_argument("--repeat", type=_positive_int,
                       help="timed runs per measurement, the best is kept (default 5)")
    bench.add_argument("--min-time", type=float, metavar="SECONDS",
                       help="keep timing each measurement until this long was spent "
                            "(default 0.5, 0.05 with --quick)")
    bench.add_argument("--plot", metavar="FILE.png",
                       help="write a log-log plot of time against sequence length")
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON")
    bench.add_argument("--decode", action="store_true",
                       help="decoding: few new queries against a long KV cache (causal, GQA), "
                            "beside torch SDPA and a streaming read of the cache")
    bench.add_argument("--shape", nargs="+", metavar="B,H,Hkv,N,M,D",
                       help="decode shapes (with --decode; default: "
                            f"{' '.join(','.join(map(str, s)) for s in _bench_decode.SHAPES)}; with --quick: "
                            f"{' '.join(','.join(map(str, s)) for s in _bench_decode.QUICK_SHAPES)})")
    bench.add_argument("--threads", type=_positive_int,
                       help="threads of the kernels, torch and NumPy's BLAS alike, set for the run and "
                            "printed (default: all cores, 1 with --quick, whose small sizes gain "
                            "nothing from threads)")
    bench.add_argument("--rounds", type=_positive_int,
                       help="interleaved rounds per decode shape (default 7, 3 with --quick)")
    bench.add_argument("--gpu", action="store_true",
                       help="the CUDA kernels against torch SDPA on the GPU, float32, one shape "
                            "(default B=4 H=16 N=4096 D=64, best of 10 runs; B=1 H=4 N=1024, best "
                            "of 3, with --quick); --json "
                            "also times the decoding shapes (as python -m elastic_np.cuda --bench)")
    bench.add_argument("--softcap", type=float, help="with --gpu: time with this soft-cap of the scores")
    bench.add_argument("--alibi", action="store_true", help="with --gpu: time with ALiBi (geometric slopes)")
    bench.add_argument("--bias", choices=sorted(cuda_bench.BENCH_BIAS_SHAPES),
                       help="with --gpu: time with a bias of this shape")
    bench.add_argument("--precision", choices=("tf32",),
                       help="with --gpu: float32 products as one TF32 product on the tensor cores")
    return bench


def main(argv=None):
    """Run the ``elastic-np`` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            args = parser.parse_args(["example"])
    except SystemExit as exc:
        return exc.code
    args.argv = list(sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():
        # the commands say what compiled themselves (first_call_line, warmup's report)
        warnings.filterwarnings("ignore", category=CompileWarning)
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
