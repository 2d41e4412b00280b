"""Measurement helpers shared by ``elastic-np bench`` and the asv suite.

Everything a side-by-side comparison needs: seeded inputs, the FLOP count of
attention, a naive NumPy attention, PyTorch's ``scaled_dot_product_attention``
(when torch is installed), a best-of-N timer and the machine's matrix-multiply
peak.
"""

import contextlib
import ctypes
import ctypes.util
import gc
import os
import platform
import threading
import time
import tracemalloc

import numba
import numpy as np

import elastic_np as enp
from elastic_np._api import compile_report, dispatch
from elastic_np._contract import _problem, _validation
from elastic_np._contract._errors import BackendUnavailableError
from elastic_np.cli._progress import first_call_line
from elastic_np.cpu import thread_count
from elastic_np.cpu._tiles import simd
from elastic_np.reference._backend import backward as _oracle_backward
from elastic_np.reference._backend import forward as _oracle_forward


def make_inputs(B, H, N, M, D, *, Hkv=None, Dv=None, dtype=np.float32, seed=0):
    """Seeded standard-normal ``q, k, v`` of shapes ``(B, H, N, D)``, ``(B, Hkv, M, D)``, ``(B, Hkv, M, Dv)``."""
    rng = np.random.default_rng(seed)
    Hkv = H if Hkv is None else Hkv
    Dv = D if Dv is None else Dv
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, Dv)).astype(dtype)
    return q, k, v


def attention_flops(B, H, N, M, D, Dv=None, *, causal=False, backward=False):
    """FLOPs of attention by the FlashAttention convention.

    The forward is two matrix products, ``2 * B * H * N * M * (D + Dv)``; causal
    keeps the fraction of the ``N x M`` matrix on or below the bottom-right
    aligned diagonal; the backward is counted as 2.5 forwards (five products).
    """
    Dv = D if Dv is None else Dv
    entries = N * M
    if causal:
        offset = M - N
        # number of (i, j) with j <= i + offset, 0 <= j < M
        kept_per_row = np.clip(np.arange(N) + offset + 1, 0, M)
        entries = int(kept_per_row.sum())
    forward = 2.0 * B * H * entries * (D + Dv)
    return forward * (3.5 if backward else 1.0)


def naive_attention(q, k, v, *, causal=False, scale=None):
    """Plain NumPy attention in the input dtype, materialising the score matrix.

    The oracle's own code (`elastic_np.reference`) evaluated in the dtype of
    ``q``, or in float32 for bfloat16 and float16 inputs (NumPy multiplies
    matrices of neither), as the kernels compute.
    """
    return _oracle_forward(_naive_problem(q, k, v, causal, scale))[0]


def _naive_problem(q, k, v, causal, scale):
    """The prepared problem of ``q, k, v`` in their compute dtype, for the oracle's code."""
    dtype = _validation.compute_dtype(q.dtype)
    q, k, v = (a.astype(dtype, copy=False) for a in (q, k, v))
    return _problem.prepare(q, k, v, causal=causal, scale=scale, dtypes=(dtype,))


def machine_info():
    """Processor, its SIMD width, core and thread counts and library versions, for a results file."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "simd_bits": 8 * simd.VECTOR_BYTES, "fma": simd.HAS_FMA,
            "cores": os.cpu_count(), "numba_threads": thread_count(),
            "python": platform.python_version(), "elastic_np": enp.__version__,
            "numpy": np.__version__, "numba": numba.__version__}
    if torch_available():
        import torch

        info["torch"] = torch.__version__
    return info


@contextlib.contextmanager
def thread_counts(threads):
    """Within the block, the kernels (Numba), torch and NumPy's BLAS each use ``threads`` threads.

    Pools that together ask for more threads than there are cores make each
    other wait (an idle OpenMP pool spins), which at small sizes costs more
    than the work. Yields ``{"numba": n, "torch": n or None, "blas": n or
    None}``: None where the library is absent (BLAS needs threadpoolctl,
    of the ``bench`` extra); each is restored afterwards.
    """
    if not (isinstance(threads, int) and 1 <= threads <= numba.config.NUMBA_NUM_THREADS):
        raise ValueError(f"`threads` must be an int from 1 to {numba.config.NUMBA_NUM_THREADS}, got {threads!r}")
    counts = {"numba": threads, "torch": None, "blas": None}
    with contextlib.ExitStack() as stack:
        before = thread_count()
        if threads != before:  # setting them starts Numba's threading layer, an OpenMP runtime beside torch's
            numba.set_num_threads(threads)
            stack.callback(numba.set_num_threads, before)
        if torch_available():
            import torch

            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(threads)
            counts["torch"] = threads
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            pass
        else:
            stack.enter_context(threadpool_limits(limits=threads, user_api="blas"))
            counts["blas"] = threads
        yield counts


#: What `thread_counts` leaves unset without each optional package, as `unset_notes` says it.
_UNSET_NOTES = {
    "torch": "torch is not installed: its threads were not set and torch sdpa is not timed",
    "blas": "NumPy's BLAS threads were not set (naive numpy ran on BLAS's own count): the optional "
            "package threadpoolctl, which sets them, is not installed (pip install threadpoolctl)",
}


def describe_threads(counts):
    """``"2 threads (kernels, torch, BLAS)"``: what `thread_counts` set (`unset_notes` says why not the others)."""
    kinds = ", ".join(["kernels"] + [name for pool, name in (("torch", "torch"), ("blas", "BLAS"))
                                     if counts.get(pool) is not None])
    return f"{counts['numba']} thread{'s' * (counts['numba'] != 1)} ({kinds})"


def unset_notes(counts):
    """``"note: ..."`` lines, one per thread pool that `thread_counts` did not set: which package is missing."""
    return [f"note: {note}" for pool, note in _UNSET_NOTES.items() if counts.get(pool, 0) is None]


def torch_tensor(a):
    """NumPy array ``a`` as a torch tensor sharing its memory (bfloat16 through a 16-bit view)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def numpy_array(t):
    """Torch tensor ``t`` as a NumPy array (bfloat16 as ``ml_dtypes.bfloat16``)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(_validation.numpy_dtype("bfloat16"))
    return t.numpy()


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_sdpa(q, k, v, *, causal=False, backward=False, dout=None):
    """Run ``torch.nn.functional.scaled_dot_product_attention`` on NumPy inputs.

    Returns the output (and with ``backward=True`` the gradients ``dq, dk, dv``)
    as NumPy arrays. Causal alignment for ``N != M`` is torch's top-left one,
    so compare only ``N == M`` causal results with elastic_np.
    """
    import torch

    H, Hkv = q.shape[1], k.shape[1]
    tq, tk, tv = (torch_tensor(a) for a in (q, k, v))
    if backward:
        for t in (tq, tk, tv):
            t.requires_grad_(True)
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=causal, enable_gqa=H != Hkv
    )
    if not backward:
        return numpy_array(out)
    grad = torch.ones_like(out) if dout is None else torch_tensor(dout)
    out.backward(grad)
    return tuple(numpy_array(t) for t in (out, tq.grad, tk.grad, tv.grad))


def best_time(fn, *, repeat=5, number=1, min_time=0.0):
    """Best wall time of ``fn()`` in seconds: the minimum over ``repeat`` runs of ``number`` calls."""
    best = np.inf
    spent = 0.0
    runs = 0
    while runs < repeat or spent < min_time:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        spent += elapsed
        runs += 1
        best = min(best, elapsed / number)
    return best


def interleaved(groups, rounds, repeat):
    """Seconds of each call, side by side: ``{group: {label: [best of repeat, per round]}}``.

    ``groups`` is ``{group: {label: fn}}``. Each call runs once first
    (compiling, warming up); then, round after round, every group times its
    calls (`best_time`), their order reversed every other round, so that
    each sees the same load.
    """
    for calls in groups.values():
        for fn in calls.values():
            fn()
    times = {group: {label: [] for label in calls} for group, calls in groups.items()}
    for r in range(rounds):
        for group, calls in groups.items():
            for label in list(calls) if r % 2 == 0 else list(calls)[::-1]:
                times[group][label].append(best_time(calls[label], repeat=repeat))
    return times


def matmul_peak_gflops(dtype=np.float32, n=2048, repeat=5, min_time=0.0):
    """GFLOP/s of ``np.dot`` on two ``n x n`` matrices: this machine's practical peak.

    The best of ``repeat`` runs (more until ``min_time`` seconds were spent).
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    np.dot(a, b)
    return 2.0 * n**3 / best_time(lambda: np.dot(a, b), repeat=repeat, min_time=min_time) / 1e9


def naive_attention_backward(q, k, v, dout, *, causal=False, scale=None):
    """Plain NumPy forward and backward in the input dtype: ``(out, dq, dk, dv)``.

    Materialises the score matrix, as an autograd framework would without a
    fused kernel; the oracle's own code evaluated in the dtype of ``q``.
    """
    p = _naive_problem(q, k, v, causal, scale)
    out, lse = _oracle_forward(p)
    grads = _oracle_backward(p, dout.astype(out.dtype, copy=False), out, lse)
    return out, grads.dq, grads.dk, grads.dv


def _rss_bytes():
    """Resident memory of this process (Linux ``/proc``); 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _release_free_heap():
    """Hand freed heap memory back to the system (glibc), so resident memory starts low."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def traced_peak_bytes(fn):
    """The peak of what one call of ``fn()`` allocates through Python's allocator (NumPy's arrays), in bytes."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def peak_memory_mib(fn, interval=2e-4):
    """Approximate peak memory of one call of ``fn()``, in MiB.

    The larger of two measurements taken during the call: the peak of the
    allocations `tracemalloc` traces (NumPy arrays and Python objects), and the
    high-water mark of the process's resident memory above its level before the
    call, sampled every ``interval`` seconds by a thread (freed heap memory is
    handed back to the system first, so that reused memory counts). The sampler
    only runs while ``fn`` releases the GIL (NumPy, torch and ``nogil`` Numba
    kernels do); for code that holds it, only what is still allocated when the
    call returns is seen, so the figure is a lower bound.
    """
    gc.collect()
    _release_free_heap()
    baseline = _rss_bytes()
    high = [baseline]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            high[0] = max(high[0], _rss_bytes())
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    tracemalloc.start()
    sampler.start()
    try:
        result = fn()
        high[0] = max(high[0], _rss_bytes())
        traced_peak = tracemalloc.get_traced_memory()[1]
    finally:
        stop.set()
        sampler.join()
        tracemalloc.stop()
    del result
    return max(traced_peak, high[0] - baseline, 0) / 2**20


def _kernel_runner(backend, causal):
    def forward(q, k, v, dout):
        return enp.attention(q, k, v, causal=causal, backend=backend)

    def forward_backward(q, k, v, dout):
        out, lse = enp.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
        return enp.attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend)

    return forward, forward_backward


def implementations(causal=False):
    """``{name: (forward, forward_backward) or reason unavailable}`` in display order."""
    impls = {}
    for backend in ("cpu", "cuda"):
        try:
            dispatch.get_backend(backend)
        except Exception as exc:  # a missing package or device, whatever its error type
            impls[f"elastic_np {backend}"] = (
                str(exc) if isinstance(exc, BackendUnavailableError)
                else f"{type(exc).__name__}: {exc}") or "not available"
        else:
            impls[f"elastic_np {backend}"] = _kernel_runner(backend, causal)
    impls["naive numpy"] = (
        lambda q, k, v, dout: naive_attention(q, k, v, causal=causal),
        lambda q, k, v, dout: naive_attention_backward(q, k, v, dout, causal=causal),
    )
    if torch_available():
        impls["torch sdpa"] = (
            lambda q, k, v, dout: torch_sdpa(q, k, v, causal=causal),
            lambda q, k, v, dout: torch_sdpa(q, k, v, causal=causal, backward=True, dout=dout),
        )
    else:
        impls["torch sdpa"] = "torch is not installed"
    return impls


PASSES = ("forward", "forward+backward")


def compare(seqs, *, batch=1, heads=8, dim=64, dtype=np.float32, causal=False, repeat=3,
            min_time=0.0, matmul_n=2048, impls=None, progress=None, threads=None):
    """Time every available implementation side by side, in this process.

    For each sequence length ``N`` (``M = N``) and each of forward and forward
    + backward, measures the best-of-``repeat`` wall time, the throughput by
    `attention_flops`, its fraction of this machine's matrix-multiply peak
    (`matmul_peak_gflops`, measured before and after, the better kept) and
    the approximate peak memory (`peak_memory_mib`) of: the elastic_np CPU kernel and CUDA kernel (when available), the naive
    NumPy attention and PyTorch's ``scaled_dot_product_attention`` (when
    installed). Every implementation is called once before it is timed, so the
    first call (a JIT compile, or a load from Numba's cache) is excluded and
    reported separately.

    Parameters
    ----------
    seqs : sequence of int
        Sequence lengths.
    batch, heads, dim : int, optional
        ``B``, ``H`` and ``D`` (``Dv = D``).
    dtype : dtype or str, optional
        float32 (default), float64, bfloat16 (ml_dtypes) or float16. For the
        halves, naive NumPy computes in float32 (`naive_attention`) and the
        peak is float32's, which the kernels compute in.
    causal : bool, optional
    repeat : int, optional
        Timed runs per measurement; the best is kept.
    min_time : float, optional
        Keep running (beyond ``repeat``) until this many seconds were spent,
        which makes the best run more robust on a busy machine.
    matmul_n : int, optional
        Matrix size of the peak measurement.
    impls : dict, optional
        What `implementations` returns (by default, called with ``causal``).
    progress : callable, optional
        ``progress(kind, message)`` with kind ``"start"`` (a long step begins,
        such as a kernel's first call), ``"stage"`` (a notice, which ends it) or
        ``"step"`` (one measurement done).
    threads : int, optional
        Threads of the kernels, torch and NumPy's BLAS alike (`thread_counts`);
        by default the kernels' present count.

    Returns
    -------
    dict
        ``config`` (with ``threads``, what `thread_counts` set), ``matmul_peak_gflops``, ``first_calls`` (of each kernel,
        `_first_calls`), ``unavailable`` (name: reason) and ``results``: a list of
        dicts with ``impl``, ``pass``, ``seq``, ``time_s``, ``gflops``,
        ``fraction_of_peak`` and ``peak_mib``.
    """
    dtype = _validation.numpy_dtype(dtype)
    notify = progress or (lambda kind, message: None)
    impls = implementations(causal) if impls is None else impls
    with thread_counts(thread_count() if threads is None else threads) as counts:
        result = _compare(seqs, batch, heads, dim, dtype, causal, repeat, min_time, matmul_n, impls, notify)
    result["config"]["threads"] = counts
    return result


def _compare(seqs, batch, heads, dim, dtype, causal, repeat, min_time, matmul_n, impls, notify):
    """`compare`'s measurements, under the thread counts it set."""
    available = {name: fns for name, fns in impls.items() if not isinstance(fns, str)}
    unavailable = {name: reason for name, reason in impls.items() if isinstance(reason, str)}

    peak_dtype = _validation.compute_dtype(dtype)
    notify("stage", f"measuring the matrix-multiply peak ({matmul_n} x {matmul_n}, {peak_dtype.name})")
    peak = matmul_peak_gflops(peak_dtype, n=matmul_n, repeat=max(repeat, 5), min_time=2 * min_time)

    first_calls = _first_calls(available, seqs, dim, dtype, notify)
    # One implementation at a time over every size: switching between thread
    # pools (OpenBLAS, torch's OpenMP, Numba's) on every call makes the idle
    # pool's spinning threads compete with the busy one.
    inputs = {}
    for seq in seqs:
        q, k, v = make_inputs(batch, heads, seq, seq, dim, dtype=dtype, seed=seq)
        dout = np.random.default_rng(seq).standard_normal(q.shape).astype(dtype)
        inputs[seq] = (q, k, v, dout)
    results = []
    for name, fns in available.items():
        for seq in seqs:
            for pass_name, fn in zip(PASSES, fns):
                call = lambda fn=fn, args=inputs[seq]: fn(*args)  # noqa: E731
                flops = attention_flops(batch, heads, seq, seq, dim, causal=causal,
                                        backward=pass_name != "forward")
                results.append({"impl": name, "pass": pass_name, "seq": int(seq),
                                **_measure(call, flops, peak, repeat, min_time)})
                notify("step", f"{name} {pass_name} N={seq}")
    order = {name: i for i, name in enumerate(available)}
    results.sort(key=lambda r: (r["seq"], r["pass"] != "forward", order[r["impl"]]))
    # The peak again, after the measurements: on a busy machine the better of the two.
    peak_after = matmul_peak_gflops(peak_dtype, n=matmul_n, repeat=max(repeat, 5), min_time=2 * min_time)
    if peak_after > peak:
        peak = peak_after
        for r in results:
            r["fraction_of_peak"] = r["gflops"] / peak
    return {
        "config": {"batch": batch, "heads": heads, "dim": dim, "dtype": dtype.name, "peak_dtype": peak_dtype.name,
                   "causal": bool(causal), "seqs": [int(s) for s in seqs], "repeat": repeat,
                   "min_time": min_time},
        "matmul_peak_gflops": peak,
        "first_calls": first_calls,
        "unavailable": unavailable,
        "results": results,
    }


def _first_calls(available, seqs, dim, dtype, notify):
    """Call each elastic_np kernel forward and backward, one head at each of ``seqs`` (the paths timed later).

    Returns ``{name: {"seconds": s, "compiled": n, "summary": text}}``: ``n``
    functions compiled, 0 when the kernels came from Numba's cache.
    """
    first = {}
    small = [(*make_inputs(1, 1, n, n, dim, dtype=dtype), np.ones((1, 1, n, dim), dtype=dtype))
             for n in sorted(set(seqs))]
    for name, fns in available.items():
        if name.startswith("elastic_np"):
            notify("start", f"{name}: first call of the forward and backward kernels: "
                            "compiling, or loading from Numba's cache")
            with compile_report.watch() as seen:
                for fn in fns:
                    for arrays in small:
                        fn(*arrays)
            notify("stage", first_call_line(name, seen))
            first[name] = {"seconds": seen.seconds, "compiled": len(seen.compiled), "summary": seen.summary()}
    return first


def _measure(call, flops, peak, repeat, min_time):
    """Time, throughput, fraction of ``peak`` and peak memory of ``call()``, after a warm-up."""
    best_time(call, repeat=1, min_time=min_time / 2)  # warm up
    seconds = best_time(call, repeat=repeat, min_time=min_time)
    gflops = flops / seconds / 1e9
    return {"time_s": seconds, "gflops": gflops, "fraction_of_peak": gflops / peak,
            "peak_mib": peak_memory_mib(call)}


def format_table(comparison):
    """The results of `compare` as a text table."""
    cfg = comparison["config"]
    lines = [
        f"attention B={cfg['batch']} H={cfg['heads']} D={cfg['dim']} {cfg['dtype']}"
        f"{' causal' if cfg['causal'] else ''}; matrix-multiply peak "
        f"{comparison['matmul_peak_gflops']:.1f} GFLOP/s"
        + (f" (in {cfg['peak_dtype']}, as the kernels compute)" if cfg.get("peak_dtype", cfg["dtype"]) != cfg["dtype"]
           else "")
        + (f"; {describe_threads(cfg['threads'])}" if "threads" in cfg else ""),
        f"  {'implementation':<18} {'pass':<16} {'N':>6} {'time (ms)':>10} {'GFLOP/s':>9} "
        f"{'of peak':>8} {'peak MiB':>9}",
    ]
    for r in comparison["results"]:
        lines.append(
            f"  {r['impl']:<18} {r['pass']:<16} {r['seq']:>6} {1e3 * r['time_s']:>10.3f} "
            f"{r['gflops']:>9.2f} {100 * r['fraction_of_peak']:>7.1f}% {r['peak_mib']:>9.1f}"
        )
    for name, first in comparison.get("first_calls", {}).items():
        lines.append(f"  {name}: first call {first['summary']}")
    for name, seconds in comparison.get("compile_s", {}).items():  # a record from before compile and load were told apart
        lines.append(f"  {name}: first call {seconds:.2f} s")
    for name, reason in comparison["unavailable"].items():
        lines.append(f"  {name}: unavailable ({reason})")
    lines.extend(unset_notes(cfg.get("threads", {})))
    return "\n".join(lines)


def plot(comparison, path):
    """Log-log plot of time against sequence length, one line per implementation and pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = dict.fromkeys(r["impl"] for r in comparison["results"])
    for color, name in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2, names):
        for pass_name, style in zip(PASSES, ("-", "--")):
            rows = [r for r in comparison["results"]
                    if r["impl"] == name and r["pass"] == pass_name]
            if rows:
                ax.loglog([r["seq"] for r in rows], [r["time_s"] for r in rows], style,
                          marker="o", color=color, label=f"{name}, {pass_name}")
    cfg = comparison["config"]
    ax.set_xlabel("sequence length N = M")
    ax.set_ylabel("time (s)")
    ax.set_title(f"attention B={cfg['batch']} H={cfg['heads']} D={cfg['dim']} {cfg['dtype']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
