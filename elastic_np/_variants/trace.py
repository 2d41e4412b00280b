"""Trace a ``score_mod`` into an expression DAG: tracer values with operator overloads, stand-ins for math and NumPy.

`trace` runs the user's function once with a `Node` in place of ``score``
and of each index, and a `CaptureTracer` in place of each capture array,
and returns the recorded `Graph`. ``math.exp(node)`` cannot be intercepted
by operator overloads, so the function runs as a copy of itself
(`_Rebinder`) whose globals, builtins and closure cells hold stand-ins for
the ``math`` and ``numpy`` modules and for their functions and the
builtins ``abs``, ``min``, ``max``, ``int``, ``float``, ``round``; the user's
own Python (or ``numba.njit``) functions found there are rebound the same
way when first called. A stand-in called on constants alone calls the real
function.

A node has a kind: ``"int"`` (index arithmetic, integer capture reads),
``"float"`` or ``"bool"``, with Python's and Numba's scalar rules: ``/`` gives
a float, ``//`` and ``%`` floor, a bool in arithmetic counts as the int 0 or 1,
``int()`` truncates, ``round()`` rounds half to even. Every unsupported
construct is a `TypeError` at trace time whose message starts with
``score_mod``.

Supported on traced values: ``+ - * / // % **`` (``divmod``), unary ``- + abs``,
the comparisons, ``& | ^ ~`` (on bools or ints); `MATH_FUNCTIONS`,
`NUMPY_FUNCTIONS` and `BUILTIN_FUNCTIONS`; ``.astype(dtype)``; indexing a
capture with integers (all of its axes, at once or one after another).
"""

import builtins
import functools
import math
import types
import warnings

import numpy as np

FLOAT, INT, BOOL = "float", "int", "bool"

#: The function's arguments before the captures, and their kinds.
INPUTS = (("score", FLOAT), ("b", INT), ("h", INT), ("q_idx", INT), ("kv_idx", INT))
#: Ops whose value is a float, a bool, an int whatever their arguments' kinds.
FLOAT_OPS = frozenset({"truediv", "exp", "log", "log2", "log10", "log1p", "expm1", "sqrt", "tanh", "sinh",
                       "cosh", "sin", "cos", "tan", "atan", "floor", "ceil", "copysign", "tofloat", "f32"})
BOOL_OPS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "lnot"})
INT_OPS = frozenset({"ftoi", "rtoi"})
LOGIC_OPS = frozenset({"and", "or", "xor", "invert"})
#: Ops that take a bool as it is (the others count it as the int 0 or 1).
_KEEP_BOOL = BOOL_OPS | LOGIC_OPS | {"where"}
#: The float functions of one argument, by the name of their op.
UNARY = ("exp", "log", "log2", "log10", "log1p", "expm1", "sqrt", "tanh", "sinh", "cosh", "sin", "cos", "tan", "atan")

BOOL_CONTEXT = ("score_mod: a traced value was used where Python needs a bool (if, while, and, or, not, bool(), "
                "a chained comparison); write numpy.where(condition, a, b) instead")
_TO_NUMBER = ("score_mod: a traced value was converted to a Python number (float(), int() of the real builtins, "
              "or a function the tracer does not know); use the math, numpy and builtin functions listed in "
              "elastic_np._variants.trace")


class Node:
    """One value of the traced function: an input, a constant, a capture read or an op on earlier nodes."""

    __slots__ = ("graph", "index", "op", "args", "kind", "attr")

    def __init__(self, graph, index, op, args, kind, attr):
        self.graph, self.index, self.op, self.args, self.kind, self.attr = graph, index, op, args, kind, attr

    def __repr__(self):
        attr = "" if self.attr is None else f"[{self.attr!r}]"
        return f"%{self.index} = {self.op}{attr}({', '.join(f'%{a.index}' for a in self.args)}): {self.kind}"

    def __bool__(self):
        raise TypeError(BOOL_CONTEXT)

    def __index__(self):
        raise TypeError("score_mod: a traced value was used as a Python index or size (of a list, a constant "
                        "array, range()); pass the array as a capture and index that")

    def __float__(self):
        raise TypeError(_TO_NUMBER)

    __int__ = __complex__ = __float__

    def __iter__(self):
        raise TypeError("score_mod: a traced value is a scalar and cannot be iterated or unpacked")

    def __pos__(self):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise TypeError(f"score_mod: the attribute .{name} of a traced value is not supported (only .astype)")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "__call__" and not kwargs and ufunc.__name__ in NUMPY_FUNCTIONS:
            return NUMPY_FUNCTIONS[ufunc.__name__](*inputs)
        raise TypeError(f"score_mod: numpy.{ufunc.__name__} (ufunc method {method!r}) is not supported on "
                        "traced values")

    def __array_function__(self, func, types_, args, kwargs):
        name = getattr(func, "__name__", repr(func))
        if name in NUMPY_FUNCTIONS and not kwargs:
            return NUMPY_FUNCTIONS[name](*args)
        raise TypeError(f"score_mod: numpy.{name} is not supported on traced values")


def _operator(op, reflected):
    def method(self, other):
        return apply(op, other, self) if reflected else apply(op, self, other)
    method.__name__ = f"__{'r' if reflected else ''}{op}__"
    return method


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor"):
    setattr(Node, f"__{_op}__", _operator(_op, False))
    setattr(Node, f"__r{_op}__", _operator(_op, True))
for _op in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(Node, f"__{_op}__", _operator(_op, False))

_UFUNC_OPS = {"add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "truediv", "divide": "truediv",
              "floor_divide": "floordiv", "remainder": "mod", "power": "pow", "negative": "neg", "less": "lt",
              "less_equal": "le", "greater": "gt", "greater_equal": "ge", "equal": "eq", "not_equal": "ne",
              "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor", "invert": "invert"}


def _graph_of(args):
    for a in args:
        if isinstance(a, (Node, CaptureTracer)):
            return a.graph
    raise TypeError("score_mod: internal error: an op without a traced argument")


def apply(op, *args):
    """The node of ``op`` on ``args`` (nodes or constants), its kind by Python's scalar rules."""
    graph = _graph_of(args)
    nodes = [graph.lift(a) for a in args]
    special = _SPECIAL.get(op)
    if special is not None:
        return special(graph, *nodes)
    if op not in _KEEP_BOOL:
        nodes = [_int_of_bool(n) for n in nodes]
    return graph.node(op, nodes, _kind(op, nodes))


def _kind(op, nodes):
    kinds = {n.kind for n in nodes}
    for group, kind in ((FLOAT_OPS, FLOAT), (BOOL_OPS, BOOL), (INT_OPS, INT)):
        if op in group:
            return kind
    if op in LOGIC_OPS:
        if FLOAT in kinds:
            raise TypeError(f"score_mod: the bitwise operator {op!r} on a float; compare first (x > 0) "
                            "or convert with int()")
        return BOOL if kinds == {BOOL} else INT
    return FLOAT if FLOAT in kinds else INT


def _int_of_bool(n):
    if n.kind != BOOL:
        return n
    return n.graph.node("where", [n, n.graph.const(1), n.graph.const(0)], INT)


def _where(graph, c, x, y):
    if c.kind != BOOL:
        c = graph.node("ne", [c, graph.const(0)], BOOL)
    if not x.kind == y.kind == BOOL:
        x, y = _int_of_bool(x), _int_of_bool(y)
    kind = x.kind if x.kind == y.kind else FLOAT
    return graph.node("where", [c, x, y], kind)


def _pow(graph, x, y):
    x, y = _int_of_bool(x), _int_of_bool(y)
    if x.kind == INT and y.kind == INT:
        if y.op == "const" and y.attr >= 0:
            return graph.node("pow", [x, y], INT)
        x = to_float(x)
    return graph.node("pow", [x, y], FLOAT)


def _invert(graph, x):
    if x.kind == BOOL:
        return graph.node("lnot", [x], BOOL)
    return graph.node("invert", [x], _kind("invert", [x]))


_SPECIAL = {"where": _where, "pow": _pow, "invert": _invert}


def _lifted(x):
    return _graph_of([x]).lift(x)


def _floats(*args):
    graph = _graph_of(args)
    return [to_float(graph.lift(a)) for a in args]


def to_float(x):
    """``float(x)``: a float node."""
    x = _lifted(x)
    return x if x.kind == FLOAT else apply("tofloat", x)


def to_int(x):
    """``int(x)``: truncated toward zero."""
    x = _lifted(x)
    return apply("ftoi", x) if x.kind == FLOAT else _int_of_bool(x)


def to_rounded(x, ndigits=None):
    """``round(x)``: the nearest int, half to even."""
    if ndigits is not None:
        raise TypeError("score_mod: round(x, ndigits) is not supported on traced values; use round(x)")
    x = _lifted(x)
    return apply("rtoi", x) if x.kind == FLOAT else _int_of_bool(x)


def math_floor(x):
    """``math.floor(x)``: an int."""
    x = _lifted(x)
    return to_int(apply("floor", x)) if x.kind == FLOAT else _int_of_bool(x)


def math_ceil(x):
    """``math.ceil(x)``: an int."""
    x = _lifted(x)
    return to_int(apply("ceil", x)) if x.kind == FLOAT else _int_of_bool(x)


def cast(x, dtype):
    """``x.astype(dtype)``, ``numpy.float32(x)`` and the like: to bool, an integer or a float dtype."""
    dtype = np.dtype(getattr(dtype, "_real", dtype))
    if dtype.kind == "b":
        return apply("ne", x, 0)
    if dtype.kind in "iu":
        return to_int(x)
    if dtype.kind == "f" and dtype.itemsize in (4, 8):
        x = to_float(x)
        return x if dtype.itemsize == 8 else apply("f32", x)
    raise TypeError(f"score_mod: conversion of a traced value to {dtype} is not supported")


def _unary(op):
    return lambda x: apply(op, x)


def _binary(op):
    return lambda x, y: apply(op, x, y)


def _reduction(op, real):
    def trace(*args):
        values = list(args[0] if len(args) == 1 else args)
        if not values:
            raise TypeError(f"score_mod: {real.__name__}() of nothing")
        out = values[0]
        for v in values[1:]:
            traced = isinstance(out, (Node, CaptureTracer)) or isinstance(v, (Node, CaptureTracer))
            out = apply(op, out, v) if traced else real(out, v)
        return out
    return trace


def _clip(x, lo, hi):
    return apply("clip", x, -math.inf if lo is None else lo, math.inf if hi is None else hi)


#: The traced ``math`` functions.
MATH_FUNCTIONS = {**{name: _unary(name) for name in UNARY},
                  "floor": math_floor, "ceil": math_ceil, "fabs": lambda x: apply("abs", to_float(x)),
                  "pow": lambda x, y: apply("pow", *_floats(x, y)), "copysign": _binary("copysign")}
#: The traced ``numpy`` functions.
NUMPY_FUNCTIONS = {**{name: _unary(name) for name in UNARY + ("floor", "ceil", "sign", "square", "abs")},
                   "arctan": _unary("atan"), "absolute": _unary("abs"),
                   "fabs": lambda x: apply("abs", to_float(x)),
                   "minimum": _binary("minimum"), "maximum": _binary("maximum"), "clip": _clip,
                   "where": lambda c, x, y: apply("where", c, x, y), "power": _binary("pow"),
                   "copysign": _binary("copysign"),
                   **{name: functools.partial(cast, dtype=getattr(np, name))
                      for name in ("float64", "float32", "int64", "int32")}}
NUMPY_FUNCTIONS.update({name: functools.partial(apply, op) for name, op in _UFUNC_OPS.items()
                        if name not in NUMPY_FUNCTIONS})
Node.__neg__, Node.__abs__, Node.__invert__ = _unary("neg"), _unary("abs"), _unary("invert")
Node.__round__, Node.__floor__, Node.__ceil__, Node.__trunc__ = to_rounded, math_floor, math_ceil, to_int
Node.__divmod__ = lambda x, y: (apply("floordiv", x, y), apply("mod", x, y))
Node.__rdivmod__ = lambda x, y: (apply("floordiv", y, x), apply("mod", y, x))
Node.astype = cast
#: The traced builtins.
BUILTIN_FUNCTIONS = {"abs": _unary("abs"), "min": _reduction("minimum", builtins.min),
                     "max": _reduction("maximum", builtins.max), "int": to_int,
                     "float": to_float, "round": to_rounded}


class CaptureTracer:
    """A capture array while tracing: integer indexing records a read; its ``shape``, ``dtype``... are the array's."""

    def __init__(self, graph, number, array, prefix=()):
        self.graph, self.number, self.array, self.prefix = graph, number, array, prefix

    shape = property(lambda self: self.array.shape[len(self.prefix):])
    ndim = property(lambda self: len(self.shape))
    dtype = property(lambda self: self.array.dtype)
    size = property(lambda self: math.prod(self.shape))

    def __len__(self):
        if not self.shape:
            raise TypeError(f"score_mod: len() of capture {self.number}, which has no axis left")
        return self.shape[0]

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        full = self.prefix + tuple(self._index(k) for k in key)
        if len(full) > self.array.ndim:
            raise TypeError(f"score_mod: capture {self.number} has {self.array.ndim} axes and was given "
                            f"{len(full)} indices")
        if len(full) < self.array.ndim:
            return CaptureTracer(self.graph, self.number, self.array, full)
        return self.graph.node("read", list(full), _DTYPE_KINDS[self.array.dtype.kind], self.number)

    def _index(self, k):
        if isinstance(k, Node) and k.kind == INT:
            return k
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            return self.graph.const(int(k))
        what = f"a {k.kind} value" if isinstance(k, Node) else repr(k)
        raise TypeError(f"score_mod: capture {self.number} indexed with {what}; only integers (traced or "
                        "constant) index a capture, one per axis (no slices, masks or floats)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise TypeError(f"score_mod: capture {self.number}.{name} is not supported; a capture gives its shape, "
                        "ndim, dtype, size and len(), and its entries by integer indexing")

    def _whole(self, *args, **kwargs):
        raise TypeError(f"score_mod: capture {self.number} used as a whole array; index it with integers, "
                        "as in table[h, q_idx - kv_idx]")

    __bool__ = __float__ = __int__ = __index__ = __iter__ = __array__ = _whole


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "neg", "abs"):
    setattr(CaptureTracer, f"__{_op}__", CaptureTracer._whole)
    setattr(CaptureTracer, f"__r{_op}__", CaptureTracer._whole)

_DTYPE_KINDS = {"f": FLOAT, "i": INT, "u": INT, "b": BOOL}


class Graph:
    """The recorded DAG: its nodes in the order made (each after its arguments), inputs, captures and output.

    Attributes
    ----------
    nodes : list of Node
    inputs : dict
        ``score``, ``b``, ``h``, ``q_idx``, ``kv_idx``: their nodes.
    captures : tuple
        Per capture, ``(dtype, shape)``.
    output : Node
        What the function returned.
    """

    def __init__(self, captures):
        self.nodes, self._memo, self.captures, self.output = [], {}, captures, None
        self.inputs = {name: self.node(name, [], kind) for name, kind in INPUTS}

    def node(self, op, args, kind, attr=None):
        """The node of ``op`` on ``args``: an equal one made before, else a new one."""
        key = (op, tuple(a.index for a in args), (type(attr).__name__, repr(attr)))
        found = self._memo.get(key)
        if found is None:
            found = Node(self, len(self.nodes), op, tuple(args), kind, attr)
            self.nodes.append(found)
            self._memo[key] = found
        return found

    def const(self, value):
        """The node of the constant ``value`` (a Python bool, int or float)."""
        kind = BOOL if isinstance(value, bool) else INT if isinstance(value, int) else FLOAT
        return self.node("const", [], kind, value)

    def lift(self, x):
        """``x`` as a node of this graph: a node, or a constant number."""
        if isinstance(x, Node):
            if x.graph is not self:
                raise TypeError("score_mod: a traced value of another trace")
            return x
        if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "biuf":
            x = x.item()
        for types_, convert in ((bool, np.bool_), bool), ((int, np.integer), int), ((float, np.floating), float):
            if isinstance(x, types_):
                return self.const(convert(x))
        if isinstance(x, CaptureTracer):
            x._whole()
        raise TypeError(f"score_mod: a traced value combined with a {type(x).__name__}; only numbers, traced "
                        "values and reads of the captures are supported")

    def __str__(self):
        return "\n".join([*map(repr, self.nodes), f"return %{self.output.index}"])


class _StandIn:
    """A function of math, NumPy or the builtins while tracing: traced on traced arguments, itself otherwise."""

    __slots__ = ("_real", "_trace", "_label", "dtype")

    def __init__(self, real, trace_fn, label):
        self._real, self._trace, self._label = real, trace_fn, label
        self.dtype = np.dtype(real) if isinstance(real, type) and issubclass(real, np.generic) else None

    def __call__(self, *args, **kwargs):
        if not _any_traced(args) and not _any_traced(kwargs.values()):
            return self._real(*args, **kwargs)
        if self._trace is None:
            raise TypeError(f"score_mod: {self._label} is not supported on traced values (the supported "
                            "functions are listed in elastic_np._variants.trace)")
        if kwargs:
            raise TypeError(f"score_mod: {self._label} with keyword arguments is not supported on traced values")
        return self._trace(*args)

    def __getattr__(self, name):
        if name in ("_real", "_trace", "_label"):  # unset: a copy made without __init__
            raise AttributeError(name)
        return getattr(self._real, name)

    def __repr__(self):
        return f"<tracing {self._label}>"


def _any_traced(values):
    traced = (Node, CaptureTracer)
    return any(isinstance(v, traced) or (isinstance(v, (tuple, list)) and any(isinstance(x, traced) for x in v))
               for v in values)


@functools.cache
def _known():
    """``id(function) -> (function, stand-in)`` for every function of math and NumPy and the traced builtins."""
    table = {}
    sources = ((math, MATH_FUNCTIONS, "math."), (np, NUMPY_FUNCTIONS, "numpy."), (builtins, BUILTIN_FUNCTIONS, ""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module, traced, prefix in sources:
            for name, trace_fn in traced.items():
                if (obj := getattr(module, name, None)) is not None:
                    table[id(obj)] = (obj, _StandIn(obj, trace_fn, prefix + name))
        for module, _, prefix in sources[:2]:
            for name in dir(module):
                obj = getattr(module, name, None)
                if callable(obj) and not isinstance(obj, type):
                    table.setdefault(id(obj), (obj, _StandIn(obj, None, prefix + name)))
    return table


def _standin(value):
    entry = _known().get(id(value))
    return entry[1] if entry is not None and entry[0] is value else None


class _TracingModule(types.ModuleType):
    """``math`` or ``numpy`` while tracing: its functions as stand-ins, its other attributes its own."""

    def __init__(self, real):
        super().__init__(real.__name__)
        self._real = real

    def __getattr__(self, name):
        value = getattr(self._real, name)
        standin = _standin(value)
        return value if standin is None else standin


_MODULES = {id(math): _TracingModule(math), id(np): _TracingModule(np)}


class _Lazy:
    """A user's function in a rebound namespace: rebound itself when first called."""

    def __init__(self, rebinder, fn):
        self._rebinder, self._fn, self._rebound = rebinder, fn, None

    def __call__(self, *args, **kwargs):
        if self._rebound is None:
            self._rebound = self._rebinder.function(self._fn)
        return self._rebound(*args, **kwargs)

    def __getattr__(self, name):
        if name in ("_fn", "_rebinder", "_rebound"):
            raise AttributeError(name)
        return getattr(self._fn, name)


class _Rebinder:
    """Copies of functions whose globals, builtins, closure cells and defaults hold the tracing stand-ins."""

    def __init__(self):
        self._namespaces, self._functions = {}, {}

    def function(self, fn):
        """The copy of the Python function ``fn``."""
        entry = self._functions.get(id(fn))
        if entry is None:
            closure = None if fn.__closure__ is None else tuple(map(self._cell, fn.__closure__))
            defaults = None if fn.__defaults__ is None else tuple(map(self.value, fn.__defaults__))
            new = types.FunctionType(fn.__code__, self._namespace(fn.__globals__), fn.__name__, defaults, closure)
            if fn.__kwdefaults__:
                new.__kwdefaults__ = {k: self.value(v) for k, v in fn.__kwdefaults__.items()}
            entry = self._functions[id(fn)] = (fn, new)  # fn kept alive: its id stays its own
        return entry[1]

    def value(self, v):
        """What ``v`` is while tracing: a stand-in, a lazily rebound function, or itself."""
        module = _MODULES.get(id(v))
        if module is not None and module._real is v:
            return module
        standin = _standin(v)
        if standin is not None:
            return standin
        if isinstance(v, types.FunctionType):
            return _Lazy(self, v)
        if type(v).__module__.startswith("numba.") and isinstance(getattr(v, "py_func", None), types.FunctionType):
            return _Lazy(self, v.py_func)
        return v

    def _cell(self, cell):
        try:
            return types.CellType(self.value(cell.cell_contents))
        except ValueError:  # an empty cell
            return types.CellType()

    def _namespace(self, namespace):
        entry = self._namespaces.get(id(namespace))
        if entry is None:
            new = {k: self.value(v) for k, v in namespace.items()}
            base = namespace.get("__builtins__", builtins)
            new["__builtins__"] = {**(vars(base) if isinstance(base, types.ModuleType) else base),
                                   **{name: _standin(getattr(builtins, name)) for name in BUILTIN_FUNCTIONS}}
            entry = self._namespaces[id(namespace)] = (namespace, new)
        return entry[1]


def trace(score_mod, captures=()):
    """The `Graph` of ``score_mod(score, b, h, q_idx, kv_idx, *captures)``.

    Parameters
    ----------
    score_mod : callable
        A Python function (or a ``numba.njit`` one, traced through its ``py_func``).
    captures : tuple of ndarray
        Bool, integer or float arrays; their shapes and dtypes are constants of the trace.
    """
    captures = tuple(np.asarray(c) for c in captures)
    for number, c in enumerate(captures):
        if c.dtype.kind not in _DTYPE_KINDS or (c.dtype.kind == "f" and c.dtype.itemsize not in (4, 8)):
            raise TypeError(f"score_mod: capture {number} has dtype {c.dtype}; bool, integer, float32 or "
                            "float64 arrays only")
    graph = Graph(tuple((c.dtype, c.shape) for c in captures))
    fn = getattr(score_mod, "py_func", score_mod)
    if isinstance(fn, types.FunctionType):
        fn = _Rebinder().function(fn)
    out = fn(*graph.inputs.values(), *(CaptureTracer(graph, n, c) for n, c in enumerate(captures)))
    if not isinstance(out, (Node, bool, int, float, np.number, np.bool_)) and not (
            isinstance(out, np.ndarray) and out.ndim == 0):
        raise TypeError(f"score_mod must return a number (a float), not {type(out).__name__}")
    graph.output = graph.lift(out)
    return graph
