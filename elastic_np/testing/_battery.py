"""The conformance battery: every case through an implementation, and the oracle's own gradients.

Every case draws seeded inputs, evaluates the float64 oracle on them (after
rounding them to the dtype under test, so that only the computation is
measured, not the rounding of the inputs) and compares what the implementation
returns with it. The allowed error follows the FlashAttention rule
(`elastic_np.testing._tolerances.kit_allowed`):

    allowed = max(2 * error of a naive evaluation in the same dtype + rounding,
                  floor * max |oracle|)

with ``floor`` 1e-12 for float64, 1e-5 for float32 and the machine epsilon
for bfloat16 and float16. The naive evaluation is the contract's formula
written out with whole arrays in NumPy, every operation in the dtype under
test (float32 for bfloat16 and float16, whose results are then rounded to
them), in four orders of its sums, the worst of which counts; ``rounding``
(`elastic_np.testing._tolerances.rounding_allowance`) covers what no
reordering samples: the rounding of large logits and of cancelling sums. The
oracle is `elastic_np.reference`.
"""

import dataclasses
import inspect

import numpy as np

from elastic_np import reference
from elastic_np._contract import _spec
from elastic_np._contract._problem import prepare
from elastic_np._contract._types import DynamicWindow
from elastic_np.reference._backend import forward as _oracle_forward
from elastic_np.testing._cases import (
    CAPABILITIES, CASES, OPTION_NAMES, VARIANT_NAMES, case_dtypes, draw_inputs, in_dtype, quantized_cache,
    select_cases,
)
from elastic_np.testing._gradcheck import gradcheck
from elastic_np.testing._report import ConformanceReport, Row, worst_error
from elastic_np._contract._validation import numpy_dtype
from elastic_np.testing._tolerances import (
    FLOOR,
    GRADCHECK_RTOL,
    kit_allowed,
    naive_orderings,
    rounding_allowance,
)

#: The option each parameter gradient belongs to (checked when the case sets it).
_GRAD_OPTION = {option.gradient: option.name for option in _spec.OPTIONS if option.gradient}
_GRAD_NAMES = ("dq", "dk", "dv", *_GRAD_OPTION)


def supported_options(fn, options=None):
    """Option, variant and capability names ``fn`` takes: its keyword parameters plus ``options``."""
    taken = set(OPTION_NAMES) | set(VARIANT_NAMES)
    known = taken | set(CAPABILITIES)
    declared = set(options or ())
    unknown = declared - known
    if unknown:
        raise ValueError(
            f"`options` names unknown options {sorted(unknown)}; known: {sorted(known)}"
        )
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    from_signature = {
        name for name, param in params.items()
        if name in taken and param.kind is not inspect.Parameter.VAR_KEYWORD
    }
    return from_signature | declared


def _unpack_forward(result):
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise TypeError(
                f"fn returned a sequence of {len(result)} items; expected out or (out, lse)")
        return result[0], result[1]
    return result, None


def _unpack_backward(result):
    names = (*_GRAD_NAMES, "dcaptures")
    if isinstance(result, dict):
        return {name: result.get(name) for name in names}
    if isinstance(result, (tuple, list)):
        if not 3 <= len(result) <= 6:
            raise TypeError(
                f"backward returned {len(result)} items; expected 3 to 6 (dq, dk, dv, ...)")
        return dict(zip(_GRAD_NAMES, result))
    return {name: getattr(result, name, None) for name in names}


def _compare(report, case, dtype, quantity, got, want, naive, rounding=0.0):
    error, note = worst_error(got, want)
    allowed, naive_error = kit_allowed(want, naive, dtype, rounding)
    report.rows.append(Row(case, np.dtype(dtype).name, quantity, error, allowed,
                           bool(error <= allowed), note, naive_error))


def _fail(report, case, dtype, quantity, exc):
    message = f"raised {type(exc).__name__}: {exc}".splitlines()[0][:100]
    report.rows.append(Row(case, np.dtype(dtype).name, quantity, np.inf, np.nan, False, message))


def run_battery(fn, *, backward=None, supported=(), dtypes=(np.float32, np.float64),
                quick=True, seed=0, title="conformance", progress=None, cases=None):
    """Run every case of ``cases`` (default: all) that ``supported`` covers through ``fn`` (and ``backward``).

    See `elastic_np.testing.check_attention` for the calling conventions.
    ``progress`` is called as ``progress(step_label)`` after each case and dtype.
    """
    dtypes = [numpy_dtype(d) for d in dtypes]
    for d in dtypes:
        if d.name not in FLOOR:
            raise ValueError(f"`dtypes` may hold {', '.join(FLOOR)}, got {d}")
    cases, skipped = select_cases(supported, cases)
    report = ConformanceReport(title=title, skipped=[(c.name, needs) for c, needs in skipped])
    for case in cases:
        for dtype in case_dtypes(case, dtypes):
            _run_case(report, case, dtype, fn, backward, quick, seed)
            if progress is not None:
                progress(f"{case.name} {dtype.name}")
    return report


def _run_case(report, case, dtype, fn, backward, quick, seed):
    q, k, v, dout, options = draw_inputs(case, dtype, quick=quick, seed=seed)
    k, v, stored = quantized_cache(case, k, v)  # the oracle and the naive evaluations read the values
    backward = None if stored is not None else backward  # no gradient through a quantized cache
    out_ref, lse_ref = reference.attention(q, k, v, **options)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        naive = naive_orderings(q, k, v, dout, options, dtype, backward=backward is not None)
        rounding = rounding_allowance(q, k, v, dout, options, dtype=dtype)
    args, options = _implementation_inputs((q, k, v), options, dtype, stored)
    try:
        out, lse = _unpack_forward(fn(*args, **options))
    except Exception as exc:  # the implementation under test failed: report, go on
        _fail(report, case.name, dtype, "out", exc)
        return
    _compare(report, case.name, dtype, "out", out, out_ref, [n["out"] for n in naive], rounding["out"])
    if lse is not None:
        _compare(report, case.name, dtype, "lse", lse, lse_ref, [n["lse"] for n in naive], rounding["lse"])
    if backward is None:
        return
    with np.errstate(invalid="ignore", divide="ignore"):  # inf * 0 off the band; masked out
        grads_ref = reference.attention_backward(dout, q, k, v, out_ref, lse_ref, **options)
    try:
        grads = _unpack_backward(backward(np.array(dout, dtype=dtype), *args, **options))
    except Exception as exc:
        _fail(report, case.name, dtype, "grads", exc)
        return
    for name in _GRAD_NAMES:
        want = getattr(grads_ref, name)
        if name in ("dq", "dk", "dv"):
            got = grads[name]
        else:
            # tau, beta, sigma, bias gradients: checked when the case sets the
            # option and the implementation returns them.
            got = grads.get(name)
            if _GRAD_OPTION[name] not in options or got is None:
                continue
        _compare(report, case.name, dtype, name, got, want, [n[name] for n in naive], rounding.get(name, 0.0))
    _compare_captures(report, case.name, dtype, grads.get("dcaptures"), grads_ref.dcaptures, naive, rounding)


def _compare_captures(report, case, dtype, got, want, naive, rounding):
    """The gradient of each floating capture (``dcaptures[i]``), when the implementation returns them."""
    if got is None or want is None:
        return
    for i, wanted in enumerate(want):
        if wanted is not None:
            _compare(report, case, dtype, f"dcaptures[{i}]", got[i], wanted, [n["dcaptures"][i] for n in naive],
                     rounding["dcaptures"][i])


def _implementation_inputs(arrays, options, dtype, stored):
    """``(args, options)`` the implementation under test gets: ``q, k, v`` and the bias in the dtype under test
    (floating captures in the dtype it computes in), a quantized cache's bytes and scales (`quantized_cache`'s
    ``stored``) for its ``k`` and ``v``."""
    args = [np.array(a, dtype=dtype) for a in arrays]
    if "bias" in options:
        options = dict(options, bias=options["bias"].astype(dtype))
    if "captures" in options:
        options = dict(options, captures=tuple(in_dtype(c, dtype) for c in options["captures"]))
    if stored is not None:
        args[1:], options = stored[:2], {**options, **stored[2]}
    return args, options


def check_oracle_gradients(*, quick=True, seed=0, progress=None):
    """`elastic_np.reference.attention_backward` against central differences, every case.

    Runs in float64 with head dims 4 and 3 (every element of every input is
    perturbed twice); inputs are drawn away from the NVM jump and the window
    threshold. Returns a `ConformanceReport`.
    """
    report = ConformanceReport(title="float64 oracle gradients vs central differences")
    for case in (c for c in CASES if c.oracle_gradients):
        q, k, v, dout, options = draw_inputs(case, np.float64, quick=True, seed=seed,
                                             margin=1e-3, dims=(4, 3))
        out, lse = reference.attention(q, k, v, **options)
        with np.errstate(invalid="ignore", divide="ignore"):
            grads = reference.attention_backward(dout, q, k, v, out, lse, **options)
        inputs, claimed = _perturbed_inputs(q, k, v, options, grads)
        result = gradcheck(
            _oracle_loss(q, k, v, options, inputs), inputs, claimed,
            dout=dout, rtol=GRADCHECK_RTOL, raise_on_failure=False,
        )
        for entry in result.entries:
            report.rows.append(Row(case.name, "float64", "d" + entry.name, entry.error,
                                   GRADCHECK_RTOL, entry.passed, "relative"))
        if progress is not None:
            progress(case.name)
    return report


def _perturbed_inputs(q, k, v, options, grads):
    """``(inputs, claimed)``: what the gradient check perturbs (the window by its ``sigma``) and the gradients.

    A ``-inf`` bias entry (removed, gradient 0) is perturbed as 0 and stays
    ``-inf`` in the loss (`_oracle_loss`).
    """
    inputs = {"q": q, "k": k, "v": v}
    claimed = {"q": grads.dq, "k": grads.dk, "v": grads.dv}
    for option in _spec.OPTIONS:
        if option.gradient and option.name in options:
            name, value = option.name, options[option.name]
            if name == "dynamic_window":
                name, value = "sigma", np.array(value.sigma)
            elif name == "bias":
                value = np.where(np.isneginf(value), 0.0, value)
            inputs[name] = value
            claimed[name] = getattr(grads, option.gradient)
    return inputs, claimed


def _oracle_loss(q, k, v, options, inputs):
    """The oracle's ``out`` as a function of the perturbed inputs (`_perturbed_inputs`).

    Most evaluations perturb ``q``, ``k`` or ``v`` alone: their problem is prepared once.
    """
    window = options.get("dynamic_window")
    removed = np.isneginf(options["bias"]) if "bias" in options else False
    fixed = {n: options[n] for n in options if n not in _spec.LEARNABLE}
    base = {name: value for name, value in inputs.items() if name not in ("q", "k", "v")}
    prepared = prepare(q, k, v, **options)

    def loss_fn(q, k, v, tau=1.0, beta=0.0, sigma=None, bias=None):
        learned = {"tau": tau, "beta": beta, "sigma": sigma, "bias": bias}
        if all(np.array_equal(learned[name], value) for name, value in base.items()):
            return _oracle_forward(dataclasses.replace(prepared, q=q, k=k, v=v))[0]
        dw = None if sigma is None else DynamicWindow(
            sigma, sharpness=window.sharpness, threshold=window.threshold)
        if bias is not None:
            bias = np.where(removed, -np.inf, bias)
        return reference.attention(q, k, v, tau=tau, beta=beta, dynamic_window=dw,
                                   bias=bias, **fixed)[0]

    return loss_fn


def check_attention(fn, *, backward=None, options=None, dtypes=(np.float32, np.float64), seed=0,
                    quick=True, strict=False):
    """Run an attention implementation through the conformance battery.

    Each case of the battery calls ``fn`` on seeded inputs and compares the
    result with the float64 oracle under the FlashAttention rule: at most
    twice the error of a naive evaluation in the same dtype. The cases, the
    rule and the arguments' details are in the documentation's "Testing your
    own kernel".

    Parameters
    ----------
    fn : callable
        ``fn(q, k, v, **opts)`` with NumPy arrays ``q`` ``(B, H, N, D)``,
        ``k`` ``(B, Hkv, M, D)``, ``v`` ``(B, Hkv, M, Dv)`` in the dtype under
        test, returning ``out`` or ``(out, lse)``. ``opts`` holds the options
        the case sets, with the meanings of `elastic_np.attention`.
    backward : callable, optional
        ``backward(dout, q, k, v, **opts)`` returning the gradients of
        ``sum(dout * out)``: ``(dq, dk, dv)``, optionally followed by
        ``dtau, dbeta, dsigma, dbias``, or an object or dict with those
        names, such as `elastic_np.AttentionGrads`.
    options : iterable of str, optional
        Options ``fn`` takes besides its signature's keyword parameters, the
        arguments of a user's variant (``"score_mod"``, ``"mask_mod"``,
        ``"block_mask"``, ``"captures"``: their cases hold a relative-position
        bias table and a document mask to the oracle, ``dcaptures`` included
        when ``backward`` returns it), and the capabilities ``"gqa"`` and
        ``"bottom_right_causal"``. A case runs only when ``fn`` has every
        option it needs.
    dtypes : sequence of dtypes, optional
        Any of float32, float64, float16 and bfloat16.
    seed : int, optional
        Seed of the inputs.
    quick : bool, optional
        Small shapes (the default); ``False`` uses longer sequences and
        wider heads.
    strict : bool, optional
        Whether a case skipped for want of an option fails the report.

    Returns
    -------
    ConformanceReport
        True when every compared quantity passed (and, with ``strict``, no
        case was skipped); ``str()`` is the table, one row per case, dtype
        and quantity. An exception raised by ``fn`` or ``backward`` is a
        failed row naming it.

    Raises
    ------
    ValueError
        For an unknown name in ``options`` or a dtype not among those above.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> def fn(q, k, v, causal=False, beta=0.0):
    ...     return enp.attention(q, k, v, causal=causal, beta=beta, backend="reference")
    >>> report = enp.testing.check_attention(fn)
    >>> bool(report), sorted({row.case for row in report.rows})
    (True, ['beta', 'causal', 'plain', 'plain, N=20'])
    """
    supported = supported_options(fn, options)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    report = run_battery(
        fn, backward=backward, supported=supported, dtypes=dtypes, quick=quick, seed=seed,
        title=f"check_attention({name})",
    )
    report.strict = bool(strict)
    return report
