"""Plans: what a call of one layout derives from its shapes, dtype and options, made once and run many times.

`plan` makes one for an engine that calls the same layout again and again
(every layer of a model's step); `Plan.run` then checks only what may
differ between the arrays of two such calls (their type, shapes, dtype and
values) and runs the kernels. `attention` keeps the plans of the layouts it
met last (`lookup`, `keep`), and runs a call of a layout it has seen
through its plan: a call is looked up when ``q``, ``k``, ``v`` are NumPy
arrays and every option is a Python scalar (a call with an array option,
a mask or a bias, say, is validated in full every time).

A plan runs through the backend's ``planned_forward`` where it has one (the
CPU kernels); elsewhere `Plan.run` is the whole call.
"""

import math
import operator

import numpy as np

from elastic_np._api import compile_report
from elastic_np._contract import _spec, _validation
from elastic_np._contract import _problem
from elastic_np._contract._problem import Kept

#: The types of option values a call is looked up by (window_size's tuple is checked on its own).
_SCALARS = frozenset((type(None), bool, int, float, str))


class Plan:
    """`elastic_np.attention` of one layout (shapes, dtype, options), its validation and schedule made once.

    Made by `elastic_np.plan`. ``run(q, k, v)`` returns what
    ``attention(q, k, v, **options)`` returns, with the same bits and the
    same errors for the arrays' values; arrays of another shape or dtype are
    a `ValueError` or `TypeError` naming the array.

    Attributes
    ----------
    shapes : tuple of tuple
        The shapes of ``q``, ``k``, ``v`` it runs, in its ``layout``.
    dtype : numpy.dtype
        Their dtype.
    options : dict
        The options of `elastic_np.attention` it was made with (``return_lse``
        and ``backend`` included).
    """

    __slots__ = ("shapes", "dtype", "options", "_module", "_problem", "_make", "_forward", "_like", "_reported",
                 "_bnhd", "_lse")

    def __init__(self, module, problem, shapes, options, stand_ins=False):
        self.shapes, self.dtype, self.options = shapes, problem.dtype, options
        self._module, self._bnhd, self._lse = module, problem.layout == "bnhd", options["return_lse"]
        self._problem = problem if stand_ins else _without_arrays(problem)
        self._make = getattr(module, "planned_forward", None)
        self._forward = None  # the problem's planned forward, made on the first run
        self._like = None  # the planned forward of a plan that differs in its number of keys alone
        self._reported = set()  # the arrays' strides of the runs that reported their compiles

    def __repr__(self):
        q, k, v = self.shapes
        options = ", ".join(f"{name}={value!r}" for name, value in self.options.items()
                            if value is not _spec.DEFAULTS.get(name, _DEFAULTS.get(name)))
        return f"Plan(q {q}, k {k}, v {v}, {self.dtype}{', ' if options else ''}{options})"

    def resized(self, M):
        """This plan for ``k`` and ``v`` of ``M`` keys (`elastic_np._contract._problem.resized`)."""
        problem = self._problem
        k, v = (_stand_in(a.shape[:2] + (M,) + a.shape[3:], a.dtype) for a in (problem.k, problem.v))
        at = 2 if problem.layout == "bhnd" else 1
        shapes = (self.shapes[0], *(s[:at] + (M,) + s[at + 1:] for s in self.shapes[1:]))
        made = Plan(self._module, _problem.resized(problem, self.options, k, v), shapes, self.options, stand_ins=True)
        made._like = self._forward
        return made

    def run(self, q, k, v):
        """``attention(q, k, v, **self.options)`` for arrays of the plan's shapes and dtype.

        Returns
        -------
        out : ndarray
        lse : ndarray
            With ``return_lse=True``.

        Raises
        ------
        ValueError
            For an array of another shape, or a NaN or inf in ``q``, ``k`` or
            ``v`` (as `elastic_np.attention` raises it).
        TypeError
            For an array of another dtype.
        """
        arrays = (np.asarray(q), np.asarray(k), np.asarray(v))
        for name, a, shape in zip("qkv", arrays, self.shapes):
            if a.shape != shape:
                raise ValueError(f"`{name}` has shape {a.shape}; this plan runs {shape}")
            if a.dtype != self.dtype:
                raise TypeError(f"`{name}` has dtype {a.dtype}; this plan runs {self.dtype}")
        if self._make is None:
            return _call(*arrays, self.options)
        return self.run_checked(*arrays)

    def run_checked(self, q, k, v):
        """`run` for NumPy arrays known to have the plan's shapes and dtype (`lookup`'s)."""
        strides = (q.strides, k.strides, v.strides)
        if strides in self._reported:
            forward = self._forward
            if forward is None or self._bnhd:
                return self._run(q, k, v)
            out, lse = forward(q, k, v)  # `_run`'s, without its call
            return (out, lse) if self._lse else out
        # the first run of a memory layout may compile (or load) a kernel of its own: reported as the calls are
        with compile_report.reported(self._module.__name__.rsplit(".", 1)[-1], "forward", self.dtype):
            result = self._run(q, k, v)
        if len(self._reported) >= 64:  # a plan run with ever other strides keeps no growing set
            self._reported.clear()
        self._reported.add(strides)
        return result

    def _run(self, q, k, v):
        forward = self._forward
        if forward is None:
            forward = self._forward = self._make(self._problem, self._like)
            self._like = None
        if self._bnhd:
            q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
        out, lse = forward(q, k, v)  # which checks the values of q, k, v (`planned_forward`)
        if self._bnhd:
            out = out.swapaxes(1, 2)
        return (out, lse) if self._lse else out


#: The keyword parameters of `plan` besides the options.
_DEFAULTS = {"return_lse": False, "backend": "auto"}


def plan(q_shape, k_shape, v_shape=None, *, dtype=np.float32, return_lse=False, backend="auto", **options):
    """A `Plan` of `elastic_np.attention` for arrays of these shapes and ``dtype``, and these options.

    Everything a call derives from its shapes, dtype and options (the
    options' validation and arrays, the kernel's tiles and key splits) is
    derived here, once; ``plan.run(q, k, v)`` then checks the arrays alone.
    `elastic_np.attention` keeps plans of its own for the calls it can look
    up: a plan made here serves an engine that wants no lookup at all.

    Parameters
    ----------
    q_shape, k_shape : tuple of int
        ``(B, H, N, D)`` and ``(B, Hkv, M, D)`` (``(B, N, H, D)`` and
        ``(B, M, Hkv, D)`` with ``layout="bnhd"``).
    v_shape : tuple of int, optional
        Default ``k_shape``.
    dtype : dtype, optional
        Of ``q``, ``k``, ``v``; default float32.
    return_lse, backend, **options
        As `elastic_np.attention` takes them; array options (a mask, a
        bias, per-head ``tau``) are taken as they are now: the plan keeps a
        copy of what it derives from them.

    Returns
    -------
    Plan

    Raises
    ------
    TypeError, ValueError
        As `elastic_np.attention` raises them for these shapes and options.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> step = enp.plan((1, 8, 1, 64), (1, 2, 128, 64), causal=True, backend="cpu")
    >>> q, k = np.ones((1, 8, 1, 64), np.float32), np.ones((1, 2, 128, 64), np.float32)
    >>> step.run(q, k, k).shape
    (1, 8, 1, 64)
    """
    from elastic_np._api import dispatch

    options = _spec.complete(options, "plan")
    dtype = np.dtype(dtype)
    shapes = tuple(tuple(_index(n, name) for n in shape) for name, shape in
                   zip(("q_shape", "k_shape", "v_shape"), (q_shape, k_shape, k_shape if v_shape is None else v_shape)))
    options = {**options, "return_lse": _validation.boolean(return_lse, "return_lse"), "backend": backend}
    module = dispatch.get_backend(backend)
    if module.dtypes is None:
        raise ValueError("backend 'reference' has no plans: it computes every call in full, in float64")
    stand_ins = [_stand_in(shape, dtype) for shape in shapes]
    problem = dispatch.validated(module, *stand_ins, _spec.gathered(options))
    return Plan(module, problem, shapes, options)


def _index(n, name):
    """``n`` as an int, or a `TypeError` naming ``name``."""
    try:
        return operator.index(n)
    except TypeError:
        raise TypeError(f"`{name}` must be a tuple of ints, got {n!r} in it") from None


def _stand_in(shape, dtype):
    """Zeros of ``shape`` and ``dtype`` in one element's memory, read-only (NumPy's ``broadcast_to`` takes
    microseconds more, on every call that makes a plan)."""
    return np.ndarray(shape, dtype, buffer=_ZEROS, strides=(0,) * len(shape))


_ZEROS = bytes(16)  # one element of any dtype


def _call(q, k, v, options):
    from elastic_np._api.dispatch import attention

    return attention(q, k, v, **options)


def key(q, k, v, values, floats, window_size):
    """The key `attention` looks a call up by, or None where it is not looked up.

    ``values``: the value of every option but ``window_size``, and
    ``return_lse`` and ``backend`` (in the order of `KEYED`); ``floats``:
    those that may be a float. ``window_size`` is keyed when it is a tuple
    of two ints. The values enter with their types (``1``, ``1.0`` and
    ``True`` are told apart), and a negative float zero, whose sign ``==``
    does not see, is not keyed. The key is `with_arrays` of `options_key`.
    """
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return None
    options = options_key(values, floats, window_size)
    return None if options is None else with_arrays(q, k, v, options)


#: The names of `key`'s ``values``, in order: every option but ``window_size``, then ``return_lse`` and ``backend``.
KEYED = tuple(name for name in _spec.NAMES if name != "window_size") + ("return_lse", "backend")
#: The place of ``layout`` among them.
_LAYOUT = KEYED.index("layout")
#: The names among them whose values may be floats (`key`'s ``floats``).
FLOATS = ("scale", "tau", "beta", "softcap")


def options_key(values, floats, window_size):
    """The options' part of `key` (see there), or None where they are not keyed.

    An adapter that calls one layout with the same options again and again
    makes it once and looks each call up by `with_arrays`.
    """
    types = tuple(map(type, values))
    if not _SCALARS.issuperset(types):
        return None
    if type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int \
            or type(window_size[1]) is not int:
        return None
    for x in floats:
        if x == 0 and type(x) is float and math.copysign(1.0, x) < 0:
            return None
    return values, types, window_size


def with_arrays(q, k, v, options):
    """`key` of NumPy arrays ``q``, ``k``, ``v`` and the options' part ``options`` (`options_key`, not None)."""
    return (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype, options)


#: `Plan`s of `attention`'s latest layouts, by `key`.
PLANS = Kept(64)
#: The latest `Plan` of each layout that differs from others in its number of keys only, by `_family`.
FAMILIES = Kept(64)


def lookup(call_key, k, v):
    """The `Plan` of ``call_key``, or one made from a plan of the same layout but for another number of keys
    (a growing cache: every decoding step has one more), or None."""
    plan = PLANS.get(call_key)
    if plan is None and call_key is not None:
        family = _family(call_key, k, v)
        kin = None if family is None else FAMILIES.get(family)
        if kin is not None:
            plan = kin.resized(k.shape[2 if kin._problem.layout == "bhnd" else 1])
            plan._reported.add(_strides(call_key))  # its kin's kernels, which have run
            PLANS.get_or_make(call_key, lambda: plan)
            FAMILIES[family] = plan
    return plan


def _family(call_key, k, v):
    """``call_key`` without the number of keys, for C-contiguous ``k`` and ``v`` of one length; else None."""
    at = 2 if call_key[9][0][_LAYOUT] == "bhnd" else 1
    if k.shape[at] != v.shape[at] or not (k.flags.c_contiguous and v.flags.c_contiguous):
        return None
    without = lambda shape: shape[:at] + shape[at + 1:]  # noqa: E731
    return call_key[0], call_key[1], call_key[2], without(k.shape), k.dtype, without(v.shape), v.dtype, call_key[9]


def keep(call_key, module, problem, options, k, v):
    """Keep a `Plan` of ``problem``, validated for a call of key ``call_key`` on ``k`` and ``v`` (as given), if its
    backend has plans."""
    if call_key is None or getattr(module, "planned_forward", None) is None:
        return
    made = Plan(module, problem, (call_key[0], call_key[3], call_key[6]), options)  # the shapes as given
    made._reported.add(_strides(call_key))  # the call that made it reported its compiles
    PLANS.get_or_make(call_key, lambda: made)
    family = _family(call_key, k, v)
    if family is not None:
        FAMILIES[family] = made


def _strides(call_key):
    """The strides of ``q``, ``k``, ``v`` in a `key`."""
    return call_key[1], call_key[4], call_key[7]


def _without_arrays(problem):
    """``problem`` with stand-ins of its ``q``, ``k``, ``v``: a plan keeps no array of the call that made it."""
    return problem.with_arrays(*(_stand_in(a.shape, a.dtype) for a in (problem.q, problem.k, problem.v)))


class BackwardPlan:
    """`elastic_np.attention_backward` of one layout, its ``q``, ``k``, ``v`` and options validated once (`keep_backward`).

    ``backward(dout, q, k, v, out, lse, dlse)`` checks ``q`` and the arrays
    of the backward (their shapes, dtypes and values, as a call in full does)
    and runs the backend's backward on the kept problem.
    """

    __slots__ = ("_module", "_problem", "_bnhd", "_reported", "_rows", "_lse", "_run", "_finite", "_below_inf")

    def __init__(self, module, problem):
        self._module, self._bnhd, self._reported = module, problem.layout == "bnhd", False
        self._problem = _without_arrays(problem)
        self._run = None  # the backend's planned backward, made on the first run (else its backward)
        # the backend's compiled checks of an array's values where it has them
        self._finite = getattr(module, "finite", _validation.all_finite)
        self._below_inf = getattr(module, "below_inf", lambda a: bool((a < np.inf).all()))
        (_, rows), _, (_, lse_shape) = problem.backward_shapes
        self._rows = (rows, problem.dtype)  # the shape and dtype of dout and out, as given
        self._lse = (lse_shape, problem.compute_dtype)

    def backward(self, dout, q, k, v, out, lse, dlse):
        """`elastic_np.attention_backward` of these arrays (``q``, ``k``, ``v`` of the plan's key)."""
        if self._bnhd:
            q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
        if not self._finite(q):
            _validation.check_finite(q, "q")  # which names it
        problem = self._problem.with_arrays(q, k, v)
        module = self._module
        if dlse is None and self._expected(dout, out, lse):
            dout, out = problem.as_bhnd(dout), problem.as_bhnd(out)
        else:  # what the check takes as given, converts or rejects, as a call in full does
            dout, out, lse, dlse = module.check_backward_arrays(problem, dout, out, lse, dlse=dlse)
        run = self._run
        if run is None:
            made = getattr(module, "planned_backward", None)
            run = self._run = module.backward if made is None else made(self._problem)
        if self._reported:
            grads = run(problem, dout, out, lse, dlse)
        else:  # a plan's first run may compile what the call that made it did not (a dlse, say)
            with compile_report.reported(module.__name__.rsplit(".", 1)[-1], "backward", self._problem.dtype):
                grads = run(problem, dout, out, lse, dlse)
            self._reported = True
        return problem.grads_as_given(grads)

    def _expected(self, dout, out, lse):
        """Whether ``dout``, ``out`` and ``lse`` are NumPy arrays of the plan's shapes and dtypes and values that
        `check_backward_arrays` passes as they are (no NaN or inf; ``lse`` may be ``-inf``)."""
        (rows, dtype), (lse_shape, lse_dtype) = self._rows, self._lse
        return (type(dout) is np.ndarray and type(out) is np.ndarray and type(lse) is np.ndarray
                and dout.shape == rows and out.shape == rows and lse.shape == lse_shape
                and dout.dtype == dtype and out.dtype == dtype and lse.dtype == lse_dtype
                and self._finite(dout) and self._finite(out) and self._below_inf(lse))


def keep_backward(call_key, module, problem):
    """Keep a `BackwardPlan` of ``problem`` (validated for a backward of key ``call_key``), if its backend has plans."""
    if call_key is not None and getattr(module, "planned_forward", None) is not None:
        made = BackwardPlan(module, problem)
        PLANS.get_or_make(call_key, lambda: made)
