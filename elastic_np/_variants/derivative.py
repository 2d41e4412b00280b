"""Exact derivatives of a user's ``score_mod``: code generated from its traced expression graph.

`differentiate` traces the function (`elastic_np._variants.trace`) and
generates from the graph two evaluators: ``vjp``, compiled by Numba for one
score at a time (what the kernels call), and ``numpy``, on NumPy arrays
(what the reference calls). Each evaluates every node forward in float64
with the operations of the user's function (a float32 score or capture is
widened first), then sweeps the nodes backward adding each node's adjoint
times its local derivative into its arguments' adjoints (reverse mode):
exact to rounding, no finite differences. Both follow NumPy's error model:
a division by zero gives an infinity or NaN (an int one 0), never an error.

Conventions where the derivative is not defined:

- ``abs(x)``: ``sign(x)``, 0 at 0; ``copysign(x, y)``: nothing to ``y``.
- ``max``, ``numpy.maximum`` (and ``min``, ``minimum``): the gradient goes to
  the larger (smaller) argument, in halves on a tie, as PyTorch's ``maximum``.
- ``clip(x, lo, hi)``: to ``x`` where ``lo <= x <= hi``, else to the bound taken.
- ``floor``, ``ceil``, ``round``, ``sign``, ``int()``, ``//``, the comparisons: none.
- ``where(c, x, y)``: to the branch chosen only.
- ``x ** y``: ``y x**(y-1)`` to ``x`` (0 where ``y == 0``), ``x**y log(x)`` to
  ``y`` (0 where ``x == 0`` and ``y >= 0``), as PyTorch; ``sqrt'(0) = inf``.
- A zero adjoint passes zero to the arguments, whatever their local
  derivative: the branch of a ``where`` not taken, inf or NaN there,
  never makes the other branch's gradient NaN.
"""

import dataclasses
import itertools
import linecache
import math
import weakref

import numpy as np
from numba import njit

from elastic_np._variants.functions import narrowed, rebound
from elastic_np._variants.trace import FLOAT, UNARY, trace

#: Binary and prefix ops written as Python operators; every other op calls the function of its name.
_BINARY = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
           "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^"}
_PREFIX = {"neg": "-", "invert": "~"}

#: Per op, per argument, its part of the adjoint ``{g}`` (None: none): ``{0}``.. the arguments, ``{out}`` the value.
GRADIENTS = {
    "add": ("{g}", "{g}"), "sub": ("{g}", "-{g}"), "mul": ("{g} * {1}", "{g} * {0}"),
    "truediv": ("{g} / {1}", "-{g} * {out} / {1}"), "mod": ("{g}", "-{g} * ({0} // {1})"),
    "pow": ("{g} * pow_dx({0}, {1})", "{g} * pow_dy({0}, {1}, {out})"),
    "neg": ("-{g}",), "abs": ("{g} * sign({0})",), "square": ("2.0 * {g} * {0}",),
    "exp": ("{g} * {out}",), "expm1": ("{g} * ({out} + 1.0)",), "log": ("{g} / {0}",),
    "log2": ("{g} / ({0} * LN2)",), "log10": ("{g} / ({0} * LN10)",), "log1p": ("{g} / (1.0 + {0})",),
    "sqrt": ("{g} * (0.5 / {out})",), "tanh": ("{g} * (1.0 - {out} * {out})",),
    "sinh": ("{g} * cosh({0})",), "cosh": ("{g} * sinh({0})",), "sin": ("{g} * cos({0})",),
    "cos": ("-{g} * sin({0})",), "tan": ("{g} * (1.0 + {out} * {out})",), "atan": ("{g} / (1.0 + {0} * {0})",),
    "copysign": ("{g} * sign({0}) * copysign(1.0, {1})", None),
    "maximum": ("tie({0}, {1}, {g})", "tie({1}, {0}, {g})"), "minimum": ("tie({1}, {0}, {g})", "tie({0}, {1}, {g})"),
    "where": (None, "where({0}, {g}, 0.0)", "where({0}, 0.0, {g})"),
    "clip": ("where(inside({0}, {1}, {2}), {g}, 0.0)", "where({0} < {1}, {g}, 0.0)",
             "where({0} > {2}, {g}, 0.0)"),
    "tofloat": ("{g}",), "f32": ("{g}",),
}

_JIT = dict(fastmath=False, nogil=True, error_model="numpy")


@njit(fastmath=False, nogil=True, error_model="numpy")
def _where(c, x, y):
    return x if c else y


@njit(fastmath=False, nogil=True, error_model="numpy")
def _maximum(x, y):
    return x if x != x or x >= y else y  # NaN in either wins, as numpy.maximum


@njit(fastmath=False, nogil=True, error_model="numpy")
def _minimum(x, y):
    return x if x != x or x <= y else y


@njit(fastmath=False, nogil=True, error_model="numpy")
def _clip(x, lo, hi):
    return _minimum(_maximum(x, lo), hi)


@njit(fastmath=False, nogil=True, error_model="numpy")
def _inside(x, lo, hi):
    return lo <= x and x <= hi


@njit(fastmath=False, nogil=True, error_model="numpy")
def _tie(x, y, g):
    """``g`` where ``x > y``, half of it on a tie, else 0: the part of ``max(x, y)``'s adjoint that goes to ``x``."""
    return g if x > y else (0.5 * g if x == y else 0.0)


@njit(fastmath=False, nogil=True, error_model="numpy")
def _pow_dx(x, y):
    return 0.0 if y == 0 else y * x ** (y - 1)


@njit(fastmath=False, nogil=True, error_model="numpy")
def _pow_dy(x, y, out):
    return 0.0 if x == 0 and y >= 0 else out * math.log(x)


@njit(fastmath=False, nogil=True, error_model="numpy")
def _square(x):
    return x * x


@njit(fastmath=False, nogil=True, error_model="numpy")
def _ftoi(x):
    return int(x)


@njit(fastmath=False, nogil=True, error_model="numpy")
def _rtoi(x):
    return round(x)


@njit(fastmath=False, nogil=True, error_model="numpy")
def _tofloat(x):
    return np.float64(x)


@njit(**_JIT)
def _tofloat32(x):
    return np.float32(x)


@njit(fastmath=False, nogil=True, error_model="numpy")
def _f32(x):
    return np.float64(np.float32(x))


@njit(fastmath=False, nogil=True, error_model="numpy")
def _lnot(x):
    return not x


@njit(fastmath=False, nogil=True, error_model="numpy")
def _asint(x):
    return np.int64(x)


#: The names the generated ``vjp`` calls (Numba, one score).
NJIT_NAMES = {**{name: getattr(math, name) for name in UNARY}, "floor": np.floor, "ceil": np.ceil,
              "sign": np.sign, "abs": abs, "copysign": math.copysign, "square": _square, "where": _where,
              "maximum": _maximum, "minimum": _minimum, "clip": _clip, "inside": _inside, "tie": _tie,
              "pow_dx": _pow_dx, "pow_dy": _pow_dy, "ftoi": _ftoi, "rtoi": _rtoi, "tofloat": _tofloat,
              "f32": _f32, "lnot": _lnot, "asint": _asint, "LN2": math.log(2.0), "LN10": math.log(10.0)}


def _sum_to(x, shape):
    """``x`` summed over the axes it was broadcast along from ``shape``."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _scatter(d, index, g, shape):
    """Add ``g`` (broadcast to ``shape``) into ``d`` at ``index``, every entry it reads, in a fixed order."""
    index = [np.asarray(i) for i in index]
    at = np.broadcast_shapes(*(i.shape for i in index))
    g = _sum_to(np.broadcast_to(g, np.broadcast_shapes(shape, at)), at)
    if not index:
        d[...] += g
        return
    wrapped = [np.broadcast_to(np.where(i < 0, i + n, i), at) for i, n in zip(index, d.shape)]
    flat = np.ravel_multi_index(wrapped, d.shape)
    d += np.bincount(np.ravel(flat), weights=np.ravel(g), minlength=d.size).reshape(d.shape)


def _np_tie(x, y, g):
    return np.where(x > y, g, np.where(x == y, 0.5 * g, 0.0))


def _np_pow_dx(x, y):
    return np.where(y == 0, 0.0, y * np.power(x, y - 1))


def _np_pow_dy(x, y, out):
    return np.where((x == 0) & (y >= 0), 0.0, out * np.log(x))


#: The names the generated ``numpy`` evaluator calls (arrays).
NUMPY_NAMES = {**{name: getattr(np, name) for name in UNARY if name != "atan"}, "atan": np.arctan,
               **{name: getattr(np, name) for name in ("floor", "ceil", "sign", "abs", "copysign", "square",
                                                      "where", "maximum", "minimum", "clip")},
               "inside": lambda x, lo, hi: (lo <= x) & (x <= hi), "tie": _np_tie,
               "pow_dx": _np_pow_dx, "pow_dy": _np_pow_dy,
               "ftoi": lambda x: np.asarray(x).astype(np.int64), "rtoi": lambda x: np.rint(x).astype(np.int64),
               "tofloat": lambda x: np.asarray(x, dtype=np.float64),
               "f32": lambda x: np.asarray(x, dtype=np.float32).astype(np.float64),
               "lnot": np.logical_not, "asint": lambda x: np.asarray(x).astype(np.int64),
               "nz": lambda g, part: np.where(g == 0, 0.0, part), "scatter": _scatter, "asarray": np.asarray,
               "zeros": np.zeros, "LN2": math.log(2.0), "LN10": math.log(10.0)}


def _name(node):
    return f"k{node.index}" if node.op == "const" else f"v{node.index}"


def _index(node):
    """The subscript of a read: ``v3, k4``, or ``()`` for a 0-d capture."""
    return ", ".join(map(_name, node.args)) or "()"


def _forward(node):
    """The expression of ``node``'s value from its arguments' names."""
    args = [_name(a) for a in node.args]
    if node.op in _BINARY:
        return f"{args[0]} {_BINARY[node.op]} {args[1]}"
    if node.op in _PREFIX:
        return f"{_PREFIX[node.op]}{args[0]}"
    if node.op == "read":
        convert = {"float": "tofloat", "int": "asint"}.get(node.kind, "")
        return f"{convert}(c{node.attr}[{_index(node)}])"
    if node.op == "score":
        return "tofloat(score)"
    if not node.args and node.op in ("b", "h", "q_idx", "kv_idx"):
        return f"asint({node.op})"
    return f"{node.op}({', '.join(args)})"


def _plan(graph):
    """The nodes the output needs, in order, and the indices of those that carry a gradient."""
    needed = {graph.output.index}
    for node in reversed(graph.nodes):
        if node.index in needed:
            needed.update(a.index for a in node.args)
    order = [n for n in graph.nodes if n.index in needed]
    active = set()
    for n in order:
        source = n.op in ("score", "read")
        if n.kind == FLOAT and (source or (n.op in GRADIENTS and any(a.index in active for a in n.args))):
            active.add(n.index)
    return order, active


def _backward(node, active, numpy):
    """The statements that pass ``node``'s adjoint to its arguments (and to a capture's gradient)."""
    g, names = f"a{node.index}", [_name(a) for a in node.args]
    lines = []
    for arg, template in zip(node.args, GRADIENTS.get(node.op, ())):
        if template is not None and arg.index in active:
            part = template.format(*names, g=g, out=_name(node))
            lines.append(f"a{arg.index} = a{arg.index} + nz({g}, {part})" if numpy else f"a{arg.index} += {part}")
    if node.op == "read" and numpy:
        index = "".join(f"{_name(a)}, " for a in node.args)
        lines.append(f"scatter(d{node.attr}, ({index}), {g}, shape)")
    elif node.op == "read":
        lines.append(f"d{node.attr}[{_index(node)}] += {g}")
    return lines


def _body(graph, order, active, numpy):
    """The generated function's lines after its capture lines: forward, then the reverse sweep."""
    lines = [f"{_name(n)} = {_forward(n)}" for n in order if n.op != "const"]
    lines += [f"a{i} = 0.0" for i in sorted(active)]
    if graph.output.index in active:
        lines.append(f"a{graph.output.index} = tofloat(gbar)")
    for node in reversed(order):
        steps = _backward(node, active, numpy) if node.index in active else []
        if steps and numpy:
            lines += steps
        elif steps:
            lines += [f"if a{node.index} != 0.0:", *(f"    {s}" for s in steps)]
    return lines


def vjp_source(graph):
    """The source of ``vjp(score, b, h, q_idx, kv_idx, captures, gbar, dcaptures)`` (Numba)."""
    order, active = _plan(graph)
    reads = [n for n in order if n.op == "read"]
    lines = [f"c{k} = captures[{k}]" for k in sorted({n.attr for n in reads})]
    lines += [f"d{k} = dcaptures[{k}]" for k in sorted({n.attr for n in reads if n.index in active})]
    lines += _body(graph, order, active, numpy=False)
    score = graph.inputs["score"].index
    lines.append(f"return a{score}" if score in active else "return 0.0")
    return "def vjp(score, b, h, q_idx, kv_idx, captures, gbar, dcaptures):\n" + "".join(
        f"    {line}\n" for line in lines)


def numpy_source(graph):
    """The source of ``evaluate(score, b, h, q_idx, kv_idx, captures, gbar, shape)`` (NumPy arrays)."""
    order, active = _plan(graph)
    floating = [dtype.kind == "f" for dtype, _ in graph.captures]
    lines = [f"c{k} = asarray(captures[{k}])" for k in range(len(floating))]
    lines += [f"d{k} = zeros(c{k}.shape)" for k, f in enumerate(floating) if f]
    lines += _body(graph, order, active, numpy=True)
    score = graph.inputs["score"].index
    dcaptures = "".join(f"d{k}, " if f else "None, " for k, f in enumerate(floating))
    lines.append(f"return {_name(graph.output)}, {f'a{score}' if score in active else '0.0'}, ({dcaptures})")
    return "def evaluate(score, b, h, q_idx, kv_idx, captures, gbar, shape):\n" + "".join(
        f"    {line}\n" for line in lines)


_COUNT = itertools.count()


def _compiled(source, name, names, graph, label, narrow=False):
    """The function ``name`` of ``source``, its globals ``names`` and the graph's constants (``narrow``:
    its float constants float32 where float32 holds them, `elastic_np._variants.functions.narrowed`)."""
    constants = {f"k{n.index}": n.attr for n in graph.nodes if n.op == "const"}
    if narrow:
        constants = {key: narrowed(value) for key, value in constants.items()}
    namespace = {**names, **constants}
    filename = f"<derivative of {label} #{next(_COUNT)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    made = namespace[name]
    return rebound(made, {}, narrow=True) if narrow else made


@dataclasses.dataclass(frozen=True, eq=False)
class Derivative:
    """The derivative of a ``score_mod`` for captures of given dtypes and shapes.

    Attributes
    ----------
    vjp : numba dispatcher
        ``vjp(score, b, h, q_idx, kv_idx, captures, gbar, dcaptures) -> float64``:
        ``gbar * d score_mod / d score``; adds ``gbar * d score_mod / d
        captures[i][index]`` into ``dcaptures[i][index]`` for each read of a
        floating capture. Callable from Python and from ``njit`` code.
    graph : elastic_np._variants.trace.Graph
        The traced expression graph.
    reads : tuple of Node
        The capture reads the value needs (``node.attr``: the capture).
    vjp_source, numpy_source : str
        The generated code.
    """

    vjp: object
    graph: object
    reads: tuple
    vjp_source: str
    numpy_source: str
    evaluate: object = dataclasses.field(repr=False)

    def numpy(self, score, b, h, q_idx, kv_idx, captures, gbar=1.0):
        """``(value, dscore, dcaptures)`` on broadcastable arrays, all float64.

        ``value``: ``score_mod``'s value, ``dscore``: ``gbar * d value / d score``,
        both of the arguments' broadcast shape; ``dcaptures``: per capture,
        the sum of ``gbar * d value / d capture`` over the entries, an array
        of its shape (None for an integer or bool capture).
        """
        score = np.asarray(score, dtype=np.float64)
        indices = [np.asarray(i).astype(np.int64, copy=False) for i in (b, h, q_idx, kv_idx)]
        gbar = np.asarray(gbar, dtype=np.float64)
        shape = np.broadcast_shapes(score.shape, *(i.shape for i in indices), gbar.shape)
        with np.errstate(all="ignore"):
            value, dscore, dcaptures = self.evaluate(score, *indices, captures, gbar, shape)
        value = np.broadcast_to(np.asarray(value, dtype=np.float64), shape).copy()
        return value, np.broadcast_to(np.asarray(dscore, dtype=np.float64), shape).copy(), dcaptures


_CACHE = weakref.WeakKeyDictionary()  # score_mod -> {captures' (dtype, shape)s: Derivative}


def _derive(score_mod, captures, names, narrow):
    graph = trace(score_mod, captures)
    label = getattr(score_mod, "__qualname__", type(score_mod).__name__)
    vjp, evaluate = vjp_source(graph), numpy_source(graph)
    vjp_names = {**NJIT_NAMES, **(names or {}), **({"tofloat": _tofloat32} if narrow else {})}
    jitted = njit(**_JIT)(_compiled(vjp, "vjp", vjp_names, graph, label, narrow))
    reads = tuple(n for n in _plan(graph)[0] if n.op == "read")
    return Derivative(jitted, graph, reads, vjp, evaluate, _compiled(evaluate, "evaluate", NUMPY_NAMES, graph, label))


def differentiate(score_mod, captures=(), names=None, narrow=False):
    """The `Derivative` of ``score_mod(score, b, h, q_idx, kv_idx, *captures)``, exact (reverse mode).

    Parameters
    ----------
    score_mod : callable
        A Python function of a float score, four int indices and the
        captures, or a ``numba.njit`` one; traced once
        (`elastic_np._variants.trace`), which raises a `TypeError` naming
        what it cannot follow.
    captures : tuple of ndarray
        Bool, integer, float32 or float64 arrays. Their dtypes and shapes are
        constants of the derivative, which is kept per function and per
        dtypes and shapes.
    names : dict, optional
        Functions the generated ``vjp`` calls instead of those of
        `NJIT_NAMES` of the same names (a backend's vectorised ``exp`` and
        ``tanh``); the derivative is kept per mapping too.
    narrow : bool, optional
        The ``vjp`` computes in float32, its constants float32 where float32
        holds them (what the float32 kernels take: their scores and
        ``score_mod`` are float32 too); the derivative is kept per setting.
    """
    captures = tuple(np.asarray(c) for c in captures)
    key = (tuple((c.dtype.str, c.shape) for c in captures), None if names is None else id(names), narrow)
    try:
        per_function = _CACHE.setdefault(score_mod, {})
    except TypeError:  # not weakly referable: not kept
        per_function = {}
    found = per_function.get(key)
    if found is None:
        found = per_function[key] = _derive(score_mod, captures, names, narrow)
    return found
