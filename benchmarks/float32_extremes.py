"""The CPU kernels' float32 error against a naive float32 evaluation's, on extreme logits.

Draws problems whose logits reach the hundreds or thousands (``q`` and ``k``
scaled by up to 10, ``tau`` down to 0.02, ALiBi over long offsets, a bias),
with causal masks, windows, ``kv_lengths``, sinks (rows whose logits all lie
far below the sink's included), soft-caps, NVM under any finite ``scale``
(negative and zero too), dynamic windows and a cotangent of ``lse`` at
random, through both forward kernels (1 to 16 queries: the decode kernel;
more: the prefill kernel), half of them with tiles small enough that the
problems span several. For each it evaluates the float64 oracle, the CPU
kernels in float32 and the naive float32 evaluation in four summation orders
(`elastic_np.testing._tolerances.naive_orderings`), and prints, for each
quantity, the distribution of ``kernel error / naive error`` (median, 99th
percentile, max) and how many results the conformance kit's rule
(`~elastic_np.testing._tolerances.kit_allowed`) accepts; then every quantity
outside the rule, or that the rule could not judge (an allowance that is not
finite where the oracle is), with the problem that reproduces it::

    python benchmarks/float32_extremes.py                 # 200 problems
    python benchmarks/float32_extremes.py --problems 20 --seed 1
    python benchmarks/float32_extremes.py --seed 1 --problem 17   # one problem, its options printed

Problem ``i`` of seed ``s`` is drawn from ``np.random.default_rng([s, i])``
alone, so that any one of a long run reproduces on its own.
"""

import argparse
import contextlib

import numpy as np

import elastic_np as enp
from elastic_np import cpu, reference
from elastic_np.testing import _tolerances
from elastic_np.testing._report import worst_error

QUANTITIES = ("out", "lse", "dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")
GRADIENTS = QUANTITIES[2:]
#: Tiles small enough that the problems span several, in both forward kernels and the backward.
SMALL_TILES = {"BLOCK_Q": 8, "BLOCK_K": 5, "SERIAL_WORK": 0, "DECODE_BLOCK_K": 5,
               "DECODE_MIN_SPLIT_KEYS": 7, "DECODE_MIN_TASKS": 64}


def log_uniform(rng, lo, hi, size=None):
    """Values between ``lo`` and ``hi`` whose logarithm is uniform."""
    return 10.0 ** rng.uniform(np.log10(lo), np.log10(hi), size)


def draw_shape(rng):
    """``(B, H, Hkv, N, M, D, Dv)``: 1 to 16 queries (the decode kernel) about half the time."""
    Hkv = int(rng.integers(1, 3))
    H = Hkv * int(rng.integers(1, 4))
    N = int(rng.integers(1, 17)) if rng.random() < 0.45 else int(rng.integers(17, 97))
    D = int(rng.choice([8, 16, 32, 40]))
    Dv = D if rng.random() < 0.7 else int(rng.choice([8, 24, 32]))
    return int(rng.integers(1, 3)), H, Hkv, N, int(rng.integers(1, 97)), D, Dv


def draw_arrays(rng, shape):
    """``q, k, v, dout``: logits up to ``width**2`` before ``tau``; now and then every one very negative."""
    B, H, Hkv, N, M, D, Dv = shape
    width = 10 ** rng.uniform(0, 1)
    q = rng.standard_normal((B, H, N, D)) * width
    k = rng.standard_normal((B, Hkv, M, D)) * width
    if rng.random() < 0.25:  # q . k / sqrt(D) near -offset for every pair: rows far below a sink
        shift = np.sqrt(log_uniform(rng, 10.0, 1e3) * np.sqrt(D)) * np.eye(D)[0]
        q, k = q + shift, k - shift
    return q, k, rng.standard_normal((B, Hkv, M, Dv)), rng.standard_normal((B, H, N, Dv))


def per_head(rng, values, H):
    """``values`` drawn once, or once per head, at random."""
    return float(values()) if rng.random() < 0.6 else np.array([values() for _ in range(H)])


def draw_logit_options(rng, shape):
    """``tau``, ``scale``, ``nvm``, ``softcap`` and ``alibi_slopes``, each at random."""
    B, H, Hkv, N, M, D, Dv = shape
    options = {}
    if rng.random() < 0.5:
        options["tau"] = per_head(rng, lambda: log_uniform(rng, 0.02, 50.0), H)
    if rng.random() < 0.2:
        options["nvm"] = True
    if rng.random() < (0.6 if "nvm" in options else 0.15):  # any finite scale, zero and negative included
        options["scale"] = float(rng.choice([0.0, -1.0, 1.0]) * log_uniform(rng, 1e-3, 3.0) / np.sqrt(D))
    if rng.random() < 0.3:
        options["softcap"] = float(log_uniform(rng, 5.0, 1e3))
    if rng.random() < 0.3:
        options["alibi_slopes"] = 2.0 ** -rng.uniform(0, 8, H)
    return options


def draw_sink(rng, H):
    """``beta``: a sink of any size, tiny ones included (``lse`` below float32's ``exp`` range)."""
    sizes = [lambda: log_uniform(rng, 1e-3, 1e3), lambda: log_uniform(rng, 1e-60, 1e-30), lambda: 0.0]
    return per_head(rng, sizes[int(rng.choice(3, p=[0.7, 0.2, 0.1]))], H)


def draw_dynamic_window(rng, shape):
    """A `enp.DynamicWindow`: ``sigma`` one, per head or per (batch, head), sharpness from 1e-3 to 100."""
    B, H = shape[:2]
    sigma_shape = [(), (1, H), (B, H)][int(rng.integers(3))]
    sigma = log_uniform(rng, 0.05, 5.0, sigma_shape)
    threshold = float(log_uniform(rng, 1e-4, 0.1)) if rng.random() < 0.3 else 0.0
    return enp.DynamicWindow(sigma, sharpness=float(log_uniform(rng, 1e-3, 100.0)), threshold=threshold)


def draw_masks(rng, shape):
    """``causal``, ``window_size`` and ``kv_lengths``, each at random."""
    B, M = shape[0], shape[4]
    options = {}
    if rng.random() < 0.4:
        options["causal"] = True
    if rng.random() < 0.2:
        options["window_size"] = (int(rng.integers(-1, 40)), int(rng.integers(-1, 40)))
    if rng.random() < 0.1:
        options["kv_lengths"] = rng.integers(0, M + 1, B)
    return options


def draw_bias(rng, shape):
    """A float32-exact bias of one of four broadcast shapes, of size up to about 100."""
    B, H, Hkv, N, M = shape[:5]
    bias_shape = [(N, M), (B, H, N, M), (1, H, 1, M), (B, 1, N, 1)][int(rng.integers(4))]
    return (rng.standard_normal(bias_shape) * log_uniform(rng, 0.1, 100.0)).astype(np.float32).astype(np.float64)


def draw(rng):
    """``(q, k, v, dout, dlse, options, small_tiles)``, float32-exact, with extreme logits.

    ``dlse`` is the cotangent of ``lse`` (None about two times in three);
    ``small_tiles``: whether the kernels run with `SMALL_TILES`.
    """
    shape = draw_shape(rng)
    B, H, Hkv, N, M, D, Dv = shape
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in draw_arrays(rng, shape))
    options = {**draw_logit_options(rng, shape), **draw_masks(rng, shape)}
    if rng.random() < 0.4:
        options["beta"] = draw_sink(rng, H)
    if rng.random() < 0.25:
        options["dynamic_window"] = draw_dynamic_window(rng, shape)
    if rng.random() < 0.3:
        options["bias"] = draw_bias(rng, shape)
    dlse = None
    if rng.random() < 0.3:
        dlse = rng.standard_normal((B, H, N)).astype(np.float32).astype(np.float64)
    return q, k, v, dout, dlse, options, bool(rng.random() < 0.5)


def problem(seed, index):
    """Problem ``index`` of seed ``seed`` (`draw`), reproducible on its own."""
    return draw(np.random.default_rng([seed, index]))


@contextlib.contextmanager
def tiles(small):
    """The CPU kernels' tiles set to `SMALL_TILES` (when ``small``) for the duration."""
    saved = {name: getattr(cpu._runtime.config, name) for name in SMALL_TILES}
    try:
        if small:
            for name, value in SMALL_TILES.items():
                setattr(cpu._runtime.config, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(cpu._runtime.config, name, value)


def oracle_results(q, k, v, dout, dlse, options):
    """The float64 oracle's ``out``, ``lse`` and gradients, by name."""
    out, lse = reference.attention(q, k, v, **options)
    with np.errstate(all="ignore"):
        grads = reference.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **options)
    return {"out": out, "lse": lse, **{name: getattr(grads, name) for name in GRADIENTS}}


def kernel_results(q, k, v, dout, dlse, options, small_tiles=False):
    """The CPU kernels' float32 ``out``, ``lse`` and gradients, by name."""
    f32 = {name: np.asarray(a, dtype=np.float32) for name, a in options.items() if name == "bias"}
    options = {**options, **f32}
    args = [a.astype(np.float32) for a in (q, k, v)]
    dlse = None if dlse is None else dlse.astype(np.float32)
    with tiles(small_tiles):
        out, lse = enp.attention(*args, return_lse=True, backend="cpu", **options)
        grads = enp.attention_backward(dout.astype(np.float32), *args, out, lse, dlse=dlse, backend="cpu", **options)
    return {"out": out, "lse": lse, **{name: getattr(grads, name) for name in GRADIENTS}}


def measure(q, k, v, dout, dlse, options, small_tiles=False):
    """``{quantity: (kernel error, naive error, allowed, note)}`` of one problem, for the quantities it has (`judge`).

    A problem the oracle rejects (`ValueError` or `TypeError`) gives ``{}``
    when the kernels reject it too, and ``{"raised": ...}`` when they do not;
    an exception of the kernels alone is ``{"raised": ...}`` too.
    """
    try:
        oracle_results(q, k, v, dout, dlse, options)
    except (ValueError, TypeError) as oracle_error:
        try:
            kernel_results(q, k, v, dout, dlse, options, small_tiles)
        except (ValueError, TypeError):
            return {}
        return {"raised": (np.inf, 0.0, 0.0, f"only the oracle raised: {oracle_error}")}
    try:
        have = kernel_results(q, k, v, dout, dlse, options, small_tiles)
    except Exception as error:  # noqa: BLE001 - every exception of the kernels is a finding
        return {"raised": (np.inf, 0.0, 0.0, f"the kernels raised {type(error).__name__}: {error}")}
    return judge(q, k, v, dout, dlse, options, have)


def judge(q, k, v, dout, dlse, options, have):
    """``{quantity: (error, naive error, allowed, note)}``: ``have`` (float32 results by name) by the kit's rule.

    ``allowed`` is `~elastic_np.testing._tolerances.kit_allowed`'s, with the
    quantity's `~elastic_np.testing._tolerances.rounding_allowance`; ``note``
    is `worst_error`'s.
    """
    want = oracle_results(q, k, v, dout, dlse, options)
    with np.errstate(all="ignore"):
        naive = _tolerances.naive_orderings(q, k, v, dout, options, np.float32, dlse=dlse)
        rounding = _tolerances.rounding_allowance(q, k, v, dout, options, dlse=dlse)
    result = {}
    for name in QUANTITIES:
        if want[name] is None:
            continue
        allowed, naive_error = _tolerances.kit_allowed(
            want[name], [n[name] for n in naive], np.float32, rounding.get(name, 0.0))
        error, note = worst_error(have[name], want[name])
        result[name] = (error, naive_error, allowed, note)
    return result


def findings(result):
    """``[(quantity, "outside" or "unjudged", note)]`` of a `measure` result.

    "unjudged": the rule's allowance is not finite (a naive evaluation that
    overflowed or gave NaN where the oracle is finite); "outside": the
    kernel's error is over a finite allowance (an exception is "outside").
    """
    found = []
    for name, (error, naive_error, allowed, note) in result.items():
        if not np.isfinite(allowed) and name != "raised":
            found.append((name, "unjudged", f"allowed {allowed:.3g}, naive {naive_error:.3g}"))
        elif not error <= allowed:
            found.append((name, "outside", f"error {error:.3g} > allowed {allowed:.3g} (naive {naive_error:.3g}) "
                                           f"{note}".rstrip()))
    return found


def short(value):
    """A number or an array of them, to 4 significant digits."""
    if np.ndim(value) == 0:
        return f"{float(value):.4g}"
    return "[" + ", ".join(f"{x:.4g}" for x in np.ravel(value)) + "]"


def describe(q, k, v, dout, dlse, options, small_tiles):
    """One line: the shape and the options of a problem."""
    parts = [f"B,H,N,M,D,Dv={q.shape[0]},{q.shape[1]},{q.shape[2]},{k.shape[2]},{q.shape[3]},{v.shape[3]}",
             f"Hkv={k.shape[1]}", f"|q|max*|k|max={np.max(np.abs(q)) * np.max(np.abs(k)):.3g}"]
    for name, value in options.items():
        if name == "bias":
            value = f"shape {value.shape} max {np.max(np.abs(value)):.3g}"
        elif name == "dynamic_window":
            value = f"sigma={short(value.sigma)} sharpness={value.sharpness:.3g} threshold={value.threshold:.3g}"
        elif name != "causal":
            value = short(value) if np.ndim(value) != 1 or len(value) != 2 or name != "window_size" else value
        parts.append(f"{name}={value}")
    parts += ["dlse" if dlse is not None else "", "small tiles" if small_tiles else ""]
    return " ".join(p for p in parts if p)


def run(seed, problems, first=0, progress=None):
    """Measure problems ``first`` to ``first + problems - 1`` of ``seed``.

    ``progress(index, found)``, when given, is called after each problem with
    its findings (`findings`), as ``(quantity, kind, note)``.

    Returns
    -------
    rows : dict
        ``{quantity: [(error, naive error, allowed), ...]}`` over the problems that have it.
    found : list
        ``(index, quantity, kind, note)`` for every quantity outside the rule or unjudged (`findings`).
    rejected : int
        Problems that the oracle and the kernels both rejected.
    """
    rows, found, rejected = {name: [] for name in QUANTITIES}, [], 0
    for index in range(first, first + problems):
        result = measure(*problem(seed, index))
        rejected += not result
        for name, (error, naive_error, allowed, _) in result.items():
            rows.setdefault(name, []).append((error, naive_error, allowed))
        found += [(index, *f) for f in findings(result)]
        if progress is not None:
            progress(index, findings(result))
    return rows, found, rejected


def print_table(rows):
    """Per quantity: kernel error / naive error (median, p99, max), naive exact, within rule, unjudged."""
    print(f"{'quantity':9s} {'median':>8s} {'p99':>8s} {'max':>8s} {'naive exact':>12s} {'within rule':>12s} "
          f"{'unjudged':>9s}")
    for name, values in rows.items():
        if not values:
            continue
        values = np.array(values)
        inexact = values[:, 1] > 0
        with np.errstate(invalid="ignore"):
            ratio = values[inexact, 0] / values[inexact, 1]
        ratio = ratio[np.isfinite(ratio)]
        stats = np.percentile(ratio, [50, 99, 100]) if ratio.size else [np.nan] * 3
        within = int(np.sum(values[:, 0] <= values[:, 2]))
        unjudged = int(np.sum(~np.isfinite(values[:, 2])))
        ratios = " ".join(f"{x:8.2f}" if x < 1e6 else f"{x:8.2g}" for x in stats)
        print(f"{name:9s} {ratios} {int(np.sum(~inexact)):12d} {within:8d}/{len(values):<5d} {unjudged:7d}")


def print_findings(seed, found):
    """Every finding, with the command that reproduces its problem and the problem's options."""
    if not found:
        print("every quantity within the rule")
        return
    print(f"{len(found)} quantities outside the rule or unjudged:")
    for index, name, kind, note in found:
        print(f"  --seed {seed} --problem {index}: {name} {kind}: {note}")
        print(f"      {describe(*problem(seed, index))}")


def progress(index, found):
    """Print ``found`` (`findings` of problem ``index``) at once, and a line every 100 problems."""
    for name, kind, note in found:
        print(f"  problem {index}: {name} {kind}: {note}", flush=True)
    if (index + 1) % 100 == 0:
        print(f"  ... {index + 1} problems", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="the index of the first problem")
    parser.add_argument("--problem", type=int, default=None, help="measure this one problem only")
    parser.add_argument("--progress", action="store_true",
                        help="print each finding as it comes, and a line every 100 problems (long runs)")
    args = parser.parse_args(argv)
    first, problems = (args.first, args.problems) if args.problem is None else (args.problem, 1)
    rows, found, rejected = run(args.seed, problems, first, progress if args.progress else None)
    print(f"{problems} problems from {first} of seed {args.seed} ({rejected} rejected by the oracle and the "
          f"kernels alike); kernel error / naive error (naive: worst of four orders)")
    print_table(rows)
    print_findings(args.seed, found)


if __name__ == "__main__":
    main()
