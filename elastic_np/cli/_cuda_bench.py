"""The CUDA benchmark: elastic_np's kernels against torch SDPA on one GPU, and its results file.

`bench` times training shapes (forward, forward + backward), `bench_decode`
decoding shapes, both in float32 against
``torch.nn.functional.scaled_dot_product_attention`` on the same GPU and the
same device memory; `bench_record` gathers them with the machine (GPU name,
driver, numba-cuda and torch versions) into the dict that ``python -m
elastic_np.cuda --bench --json FILE`` writes (`write_json`), and
`format_table` turns that dict into the table the command prints and the
docs' performance page shows (``docs/scripts/performance.py``). Needs a GPU
and PyTorch with CUDA; without them every timing function raises
`elastic_np.BackendUnavailableError` saying which is missing.
"""

import json
import platform
import sys
from importlib import metadata

import numba
import numpy as np

import elastic_np as enp
from elastic_np import cuda as enp_cuda
from elastic_np._contract._errors import BackendUnavailableError
from elastic_np.cli import _bench

#: Decoding shapes ``(B, H, Hkv, N, M, D)`` the results file records (the CPU page's first).
DECODE_SHAPES = ((1, 32, 8, 1, 8192, 128),)


def _check_gpu(what):
    """``torch`` when a GPU runs the kernels and torch has CUDA; else `BackendUnavailableError`."""
    if not enp_cuda.is_available():
        enp_cuda.check_available()
        raise BackendUnavailableError(f"{what} times real kernels; the CUDA simulator does not count")
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError(f"{what} compares with PyTorch, which is not installed ({exc})") from exc
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"{what} compares with PyTorch on the GPU; this torch has no CUDA")
    return torch


def _numba_cuda():
    """``numba.cuda``, imported when a benchmark runs (`_check_gpu` has found it usable)."""
    from numba import cuda

    return cuda


#: Bias shapes `bench` can add, as functions of ``(B, H, N)`` (``M = N``).
BENCH_BIAS_SHAPES = {
    "full": lambda B, H, N: (B, H, N, N),
    "keys": lambda B, H, N: (N, N),
    "padding": lambda B, H, N: (B, 1, 1, N),
    "rows": lambda B, H, N: (B, H, N, 1),
    "scalar": lambda B, H, N: (1,),
}


def bench(B=4, H=16, N=4096, D=64, *, causal=False, softcap=None, alibi=False, bias=None, repeat=10,
          dtype="float32", precision=None):
    """Time the kernels against ``torch.nn.functional.scaled_dot_product_attention`` in ``dtype``.

    Both run on the same GPU and the same device memory (torch CUDA tensors
    are handed to `elastic_np.attention` through ``__cuda_array_interface__``),
    forward and forward + backward, with ``N = M``.

    With score modifiers (``softcap``, ``alibi``, ``bias``) the kernels are
    timed with them and, in the same run, without them (``"elastic_np
    plain"``), so that their cost is a ratio measured side by side. PyTorch
    gets the bias as its float ``attn_mask`` (with its gradient); it has no
    soft-cap or ALiBi, so those are ours alone.

    Parameters
    ----------
    B, H, N, D : int, optional
        Batch, heads, sequence length, head dim.
    causal : bool, optional
    softcap : float, optional
        Soft-cap of the scores.
    alibi : bool, optional
        ALiBi with the usual geometric slopes ``2**(-8 (h + 1) / H)``.
    bias : str, optional
        A key of `BENCH_BIAS_SHAPES`: the bias's shape (a device array; the
        backward computes ``dbias``).
    repeat : int, optional
        Best of this many timed runs, after one warm-up run (which compiles).
    dtype : {"float32", "float64"}, optional
        Of the inputs, for both (torch SDPA computes in it too).
    precision : {None, "tf32"}, optional
        elastic_np's ``precision`` (torch keeps its own float32 default).

    Returns
    -------
    dict
        ``{"elastic_np": {"forward": s, "forward+backward": s}, "torch": {...}}``
        in seconds (and ``"elastic_np plain"`` with modifiers), plus
        ``"tflops"`` with the same layout (FlashAttention's FLOP convention).

    Raises
    ------
    elastic_np.BackendUnavailableError
        Without a usable GPU, or when PyTorch has no CUDA.
    """
    torch = _check_gpu("bench()")
    if bias is not None and bias not in BENCH_BIAS_SHAPES:
        raise ValueError(f"`bias` must be one of {sorted(BENCH_BIAS_SHAPES)} or None, got {bias!r}")
    cuda = _numba_cuda()
    arrays = _bench_arrays(B, H, N, D, bias, dtype)
    tensors = tuple(None if a is None else torch.from_numpy(a).cuda() for a in arrays)
    modifiers = _modifiers(H, softcap, alibi, tensors[4])
    precision_option = {} if precision is None else {"precision": precision}
    runs = {"elastic_np": _ours(cuda.synchronize, tensors, causal, {**modifiers, **precision_option}),
            "torch": _torch_runs(torch, tensors, causal)}
    if modifiers:
        runs["elastic_np plain"] = _ours(cuda.synchronize, tensors, causal, {})
    timings = _time_runs(runs, repeat)
    timings["tflops"] = _tflops(timings, (B, H, N, D), causal)
    return timings


def _bench_arrays(B, H, N, D, bias, dtype="float32"):
    """`bench`'s seeded inputs on the host: ``(q, k, v, dout, bias)``, ``bias`` None without one."""
    rng = np.random.default_rng(1)
    q, k, v = _bench.make_inputs(B, H, N, N, D, dtype=dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    bias_array = None
    if bias is not None:
        bias_array = rng.standard_normal(BENCH_BIAS_SHAPES[bias](B, H, N)).astype(dtype)
    return q, k, v, dout, bias_array


def _modifiers(H, softcap, alibi, bias):
    """The score modifiers `bench` passes to ``elastic_np.attention`` (empty for plain attention)."""
    modifiers = {}
    if softcap is not None:
        modifiers["softcap"] = softcap
    if alibi:
        modifiers["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    if bias is not None:
        modifiers["bias"] = bias
    return modifiers


def _ours(synchronize, tensors, causal, options):
    """``(forward, forward_backward)``: elastic_np's passes on ``tensors`` (in `_bench_arrays`' order).

    Each ends with ``synchronize()`` (``numba.cuda.synchronize``).
    """
    q, k, v, dout, _ = tensors

    def forward():
        enp.attention(q, k, v, causal=causal, return_lse=True, backend="cuda", **options)
        synchronize()

    def forward_backward():
        out, lse = enp.attention(q, k, v, causal=causal, return_lse=True, backend="cuda", **options)
        enp.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cuda", **options)
        synchronize()

    return forward, forward_backward


def _torch_runs(torch, tensors, causal):
    """``(forward, forward_backward)``: torch SDPA's passes, the bias as its float ``attn_mask``.

    The forward runs without gradients; the backward's inputs, the bias
    included, are copies that require them.
    """
    tq, tk, tv, tdout, tbias = tensors
    N = tq.shape[2]
    gq, gk, gv = (t.clone().requires_grad_(True) for t in (tq, tk, tv))
    gbias = None if tbias is None else tbias.clone().requires_grad_(True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal_mask = None
    if causal and tbias is not None:  # torch takes is_causal or attn_mask, not both
        causal_mask = torch.ones(N, N, dtype=torch.bool, device=tq.device).tril().logical_not()

    def torch_mask(t):
        if t is None:
            return None
        return t if causal_mask is None else t.masked_fill(causal_mask, float("-inf"))

    def torch_forward():
        with torch.no_grad():
            sdpa(tq, tk, tv, attn_mask=torch_mask(tbias), is_causal=causal and tbias is None)
        torch.cuda.synchronize()

    def torch_forward_backward():
        out = sdpa(gq, gk, gv, attn_mask=torch_mask(gbias), is_causal=causal and gbias is None)
        out.backward(tdout)
        torch.cuda.synchronize()

    return torch_forward, torch_forward_backward


def _time_runs(runs, repeat):
    """``{who: {"forward": s, "forward+backward": s}}``: each pass warmed up once, then best of ``repeat``."""
    timings = {}
    for who, (fwd, fwd_bwd) in runs.items():
        timings[who] = {}
        for what, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
            fn()  # warm-up (compiles)
            timings[who][what] = _bench.best_time(fn, repeat=repeat)
    return timings


def _tflops(timings, shape, causal):
    """TFLOP/s of each of `_time_runs`' ``timings``, in their layout (FlashAttention's FLOP convention)."""
    B, H, N, D = shape
    flops = {
        "forward": _bench.attention_flops(B, H, N, N, D, causal=causal),
        "forward+backward": _bench.attention_flops(B, H, N, N, D, causal=causal, backward=True),
    }
    return {who: {what: flops[what] / t / 1e12 for what, t in runs.items()} for who, runs in timings.items()}


def bench_decode(B=1, H=32, Hkv=8, N=1, M=8192, D=128, *, repeat=20):
    """Time the forward at a decoding shape against torch SDPA (``enable_gqa``), float32.

    ``N`` new queries against ``M`` cached keys, aligned to the cache's end
    (``causal=True``; torch gets the same mask as ``attn_mask`` when
    ``N > 1``, as its ``is_causal`` aligns top-left).

    Returns
    -------
    dict
        ``{"elastic_np": s, "torch": s}``, best of ``repeat`` after a
        warm-up, and ``"elastic_np kernels"``: the device time of our kernels
        alone per call (`kernel_seconds`), the rest of a call being the host's.
    """
    torch = _check_gpu("bench_decode()")
    cuda = _numba_cuda()
    q, k, v = _bench.make_inputs(B, H, N, M, D, Hkv=Hkv, dtype=np.float32)
    tq, tk, tv = (torch.from_numpy(a).cuda() for a in (q, k, v))
    mask = None
    if N > 1:
        rows = torch.arange(N, device=tq.device)[:, None] + (M - N)
        mask = torch.arange(M, device=tq.device)[None, :] <= rows

    def ours():
        enp.attention(tq, tk, tv, causal=True, return_lse=True, backend="cuda")
        cuda.synchronize()

    def theirs():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()

    timings = {}
    for who, fn in (("elastic_np", ours), ("torch", theirs)):
        fn()  # warm-up (compiles)
        timings[who] = _bench.best_time(fn, repeat=repeat)
    timings["elastic_np kernels"] = kernel_seconds(torch, ours)
    return timings


def kernel_seconds(torch, fn, calls=20):
    """The device time of the kernels one call of ``fn`` runs (seconds; copies and memsets left out).

    Summed from the kernel records of torch's profiler (CUPTI, which sees
    every kernel of the process, ours included) over ``calls`` calls.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    return sum(e.device_time_total for e in kernels) * 1e-6 / calls


def copy_bandwidth(nbytes=1 << 30, repeat=10):
    """Bytes a second of a device-to-device copy of ``nbytes`` (read plus written), best of ``repeat``."""
    torch = _check_gpu("copy_bandwidth()")
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeat):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return 2 * src.nbytes / best


def machine_info():
    """The GPU, its driver and the library versions, for a results file (needs a usable GPU)."""
    cuda = _numba_cuda()
    device = cuda.get_current_device()
    info = {
        "gpu": device.name.decode() if isinstance(device.name, bytes) else str(device.name),
        "compute_capability": ".".join(str(c) for c in device.compute_capability),
        "driver": ".".join(str(part) for part in cuda.cudadrv.driver.driver.get_version()),
        "numba_cuda": _version("numba-cuda"),
        "numba": numba.__version__,
        "elastic_np": enp.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def _version(distribution):
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _results(timings):
    """Per implementation and pass: ``{"seconds": s, "tflops": x}``, and the speed ratios against torch."""
    results = {who: {what: {"seconds": t, "tflops": timings["tflops"][who][what]} for what, t in runs.items()}
               for who, runs in timings.items() if who != "tflops"}
    ratios = {what: timings["torch"][what] / timings["elastic_np"][what] for what in timings["elastic_np"]}
    return results, ratios


def bench_record(shape, options, timings, decode, machine, command=None, runs=(), dtype="float32", precision=None):
    """The results file's dict: machine, command, the training shape's timings and the decode shapes'.

    Parameters
    ----------
    shape : (B, H, N, D)
    options : dict
        The options the training shape ran with (``causal``, ``softcap``, ...).
    timings : dict
        `bench`'s result.
    decode : list of ((B, H, Hkv, N, M, D), dict)
        Each decoding shape with `bench_decode`'s result.
    machine : dict
        `machine_info`'s result.
    command : str, optional
        The command line (default: this process's).
    runs : sequence of (dict, dict), optional
        More configurations: each `bench`'s keyword arguments (``B``, ``H``,
        ``N``, ``D``, ``dtype``, ``precision``, ``causal``) and its result.
    dtype, precision : optional
        Those of the training shape's timings (`bench`'s).

    Returns
    -------
    dict
        ``kind`` ("cuda"), ``machine``, ``command``, ``dtype``, ``precision``, ``config``
        (shape and options), ``results`` (per implementation and pass: time
        in seconds and TFLOP/s), ``speed_ratio`` (torch's time / ours, per
        pass), ``decode`` (per shape: both times and the ratio) and ``runs``
        (per further configuration: ``config``, ``results``, ``speed_ratio``).
    """
    B, H, N, D = shape
    results, ratios = _results(timings)
    more = []
    for config, run_timings in runs:
        run_results, run_ratios = _results(run_timings)
        more.append({"config": dict(config), "results": run_results, "speed_ratio": run_ratios})
    return {
        "kind": "cuda",
        "machine": machine,
        "command": command if command is not None else " ".join(["python -m elastic_np.cuda"] + sys.argv[1:]),
        "dtype": dtype,
        "precision": precision,
        "config": {"B": B, "H": H, "N": N, "M": N, "D": D, **options},
        "results": results,
        "speed_ratio": ratios,
        "decode": [_decode_entry(s, t, machine.get("copy_bandwidth")) for s, t in decode],
        "runs": more,
    }


def _decode_entry(shape, timings, copy_bandwidth):
    """A results file's entry of one decoding shape: times, ratio, and with the kernels' time their read rate.

    ``kv_read_bandwidth`` is the K/V bytes (float32) over the kernels' time;
    ``copy_fraction`` puts it over ``copy_bandwidth`` (a device-to-device
    copy's bytes read plus written a second), when that was measured.
    """
    entry = {"shape": dict(zip(("B", "H", "Hkv", "N", "M", "D"), shape)), "seconds": dict(timings),
             "speed_ratio": timings["torch"] / timings["elastic_np"]}
    kernels = timings.get("elastic_np kernels")
    if kernels:
        B, H, Hkv, N, M, D = shape
        entry["host_seconds"] = timings["elastic_np"] - kernels
        entry["kv_read_bandwidth"] = 2 * B * Hkv * M * D * 4 / kernels
        if copy_bandwidth:
            entry["copy_fraction"] = entry["kv_read_bandwidth"] / copy_bandwidth
    return entry


def write_json(record, path):
    """Write a results dict (`bench_record`) to ``path`` as indented JSON."""
    with open(path, "w") as fh:
        json.dump(record, fh, indent=2, sort_keys=True)
        fh.write("\n")


def format_table(record):
    """A results dict (`bench_record`) as the text table the command prints and the docs show.

    One line per implementation and pass (time, TFLOP/s, torch's time / its
    time), the cost of the score modifiers when plain attention ran beside
    them, then one line per decoding shape.
    """
    cfg = record["config"]
    options = " ".join(f"{name}={cfg.get(name)}" for name in ("causal", "softcap", "alibi", "bias"))
    precision = f", precision={record['precision']}" if record.get("precision") else ""
    lines = [
        f"{record['dtype']}{precision}, B={cfg['B']} H={cfg['H']} N={cfg['N']} M={cfg['M']} D={cfg['D']}, {options}",
        f"  {'implementation':<18} {'pass':<17} {'time (ms)':>10} {'TFLOP/s':>8} {'torch / this':>13}",
    ]
    results = record["results"]
    for what in ("forward", "forward+backward"):
        for who, runs in results.items():
            if what not in runs:
                continue
            ratio = ""
            if who == "elastic_np":
                ratio = f"{record['speed_ratio'][what]:.2f}"
            elif who != "torch":
                ratio = f"{results['torch'][what]['seconds'] / runs[what]['seconds']:.2f}"
            lines.append(_row(who, what, runs[what], ratio))
    for run_ in record.get("runs", ()):
        lines += _run_lines(run_)
    plain = results.get("elastic_np plain")
    if plain:
        for what, run_ in results["elastic_np"].items():
            lines.append(f"  the modifiers cost x{run_['seconds'] / plain[what]['seconds']:.2f} over plain "
                         f"attention ({what})")
    if record["decode"]:
        lines.append("decoding, float32, causal (N queries at the end of M cached keys)")
        lines.append(f"  {'B, H/Hkv, N, M, D':<24} {'elastic_np (ms)':>16} {'torch (ms)':>11} {'torch / this':>13}")
        for entry in record["decode"]:
            s = entry["shape"]
            shape = f"{s['B']}, {s['H']}/{s['Hkv']}, {s['N']}, {s['M']}, {s['D']}"
            lines.append(f"  {shape:<24} {entry['seconds']['elastic_np'] * 1e3:>16.3f} "
                         f"{entry['seconds']['torch'] * 1e3:>11.3f} {entry['speed_ratio']:>13.2f}")
            if "kv_read_bandwidth" in entry:
                fraction = f", {entry['copy_fraction']:.0%} of a device copy's rate" if "copy_fraction" in entry else ""
                lines.append(f"    kernels {entry['seconds']['elastic_np kernels'] * 1e3:.3f} ms (K/V read at "
                             f"{entry['kv_read_bandwidth'] / 1e9:.0f} GB/s{fraction}), host "
                             f"{entry['host_seconds'] * 1e3:.3f} ms")
    return "\n".join(lines)


def _run_lines(run_):
    """`format_table`'s lines of one of the record's further configurations (its ``runs``)."""
    c = run_["config"]
    lines = [f"{c.get('dtype', 'float32')}, precision={c.get('precision')}, B={c['B']} H={c['H']} "
             f"N={c['N']} D={c['D']}, causal={c.get('causal', False)}"]
    for what in ("forward", "forward+backward"):
        for who in ("elastic_np", "torch"):
            ratio = f"{run_['speed_ratio'][what]:.2f}" if who == "elastic_np" else ""
            lines.append(_row(who, what, run_["results"][who][what], ratio))
    return lines


def _row(who, what, entry, ratio):
    """One line of `format_table`: implementation, pass, time, TFLOP/s, torch's time / its time."""
    return (f"  {who:<18} {what:<17} {entry['seconds'] * 1e3:>10.3f} {entry['tflops']:>8.2f} "
            f"{ratio:>13}".rstrip())


def machine_line(machine):
    """The GPU, its driver and the library versions of a results file, as one line of text."""
    parts = [f"{machine.get('gpu', 'unknown GPU')} (compute capability {machine.get('compute_capability', '?')})",
             f"driver {machine.get('driver', '?')}", f"numba-cuda {machine.get('numba_cuda', '?')}"]
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']} (CUDA {machine.get('torch_cuda', '?')})")
    if machine.get("copy_bandwidth"):
        parts.append(f"device-to-device copy {machine['copy_bandwidth'] / 1e9:.0f} GB/s (read + written)")
    return ", ".join(parts)


#: The training shape ``(B, H, N, D)`` that `run` times unless told otherwise.
DEFAULT_SHAPE = (4, 16, 4096, 64)

#: The further configurations a results file records (`bench`'s keyword arguments).
RECORD_RUNS = (
    {"B": 4, "H": 16, "N": 4096, "D": 64, "dtype": "float32", "precision": "tf32"},
    {"B": 4, "H": 16, "N": 4096, "D": 64, "dtype": "float64"},
    {"B": 4, "H": 16, "N": 4096, "D": 128, "causal": True},
    {"B": 4, "H": 16, "N": 4096, "D": 128, "causal": True, "precision": "tf32"},
)


def run(shape=DEFAULT_SHAPE, *, causal=False, softcap=None, alibi=False, bias=None, repeat=None, json_path=None,
        command=None, dtype="float32", precision=None):
    """Time `bench` at ``shape`` and print the table; with ``json_path``, also the decode shapes, all to that file.

    What both ``python -m elastic_np.cuda --bench`` and ``elastic-np bench
    --gpu`` run. ``command`` is the command line the results file records
    (default: ``python -m elastic_np.cuda`` with this process's arguments).
    The table is `format_table` of the results dict, the one the docs'
    performance page draws from a results file.

    Returns
    -------
    dict
        `bench`'s timings.

    Raises
    ------
    elastic_np.BackendUnavailableError
        Without a usable GPU, or when PyTorch has no CUDA (before anything is
        printed or written).
    """
    B, H, N, D = shape
    options = {"causal": causal, "softcap": softcap, "alibi": alibi, "bias": bias}
    timing = {} if repeat is None else {"repeat": repeat}
    result = bench(B, H, N, D, **options, dtype=dtype, precision=precision, **timing)
    decode = []
    runs = []
    machine = dict(machine_info())
    if json_path is not None:
        runs = [(dict(config), bench(**config, **timing)) for config in RECORD_RUNS]
        decode = [(decode_shape, bench_decode(*decode_shape)) for decode_shape in DECODE_SHAPES]
        machine["copy_bandwidth"] = copy_bandwidth()
    record = bench_record(shape, options, result, decode, machine, command=command, runs=runs, dtype=dtype,
                          precision=precision)
    print(machine_line(machine))
    print(format_table(record))
    if json_path is not None:
        write_json(record, json_path)
        print(f"wrote {json_path}")
    return result
