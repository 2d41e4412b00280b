"""The ``exp`` and ``tanh`` a user's ``score_mod`` and ``mask_mod`` call in the CPU kernels: the tiles' own.

A function written with ``math.exp``, ``math.tanh``, ``numpy.exp`` or
``numpy.tanh`` is compiled with them replaced by the kernels' vectorised
implementations (`elastic_np.cpu._tiles.exp`, `elastic_np.cpu._tiles.tanh`,
within 3 ulp), so that a tile's loop over the user's function runs in
SIMD registers, as the built-in soft-cap's does; libm's scalar calls would
take five times as long (docs/variants.rst). `REPLACEMENTS` is what
`elastic_np._variants.functions.jitted` takes: the ``math`` and ``numpy``
modules a function's globals hold become copies with these two functions
replaced, and the functions themselves where a function imported them by name.
"""

import math
import types as types_module

import numpy as np
from numba import types
from numba.extending import overload

from elastic_np.cpu._tiles.exp import _exp_any
from elastic_np.cpu._tiles.tanh import tanh_any


def vector_exp(v):
    """``exp(v)`` of a float, by the tiles' vectorised exponential (compiled code only)."""
    raise NotImplementedError("only callable from compiled code")


def vector_tanh(v):
    """``tanh(v)`` of a float, by the tiles' vectorised tangent (compiled code only)."""
    raise NotImplementedError("only callable from compiled code")


def _scalar_overload(vector, fallback):
    """The overload of ``vector``: floats of 32 or 64 bits through ``vector``, anything else ``fallback``."""
    def choose(v):
        if v in (types.float32, types.float64):
            return lambda v: vector(v)
        if isinstance(v, (types.Integer, types.Boolean)):
            return lambda v: vector(np.float64(v))
        return lambda v: fallback(v)

    return choose


overload(vector_exp, inline="always")(_scalar_overload(_exp_any, np.exp))
overload(vector_tanh, inline="always")(_scalar_overload(tanh_any, np.tanh))


def _module_with(module, **functions):
    """A copy of ``module``'s namespace as a module, with ``functions`` in place of its own."""
    copy = types_module.ModuleType(module.__name__)
    copy.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")}, **functions)
    return copy


#: What a user's function calls instead, by what its globals and closure hold.
REPLACEMENTS = {
    math: _module_with(math, exp=vector_exp, tanh=vector_tanh),
    np: _module_with(np, exp=vector_exp, tanh=vector_tanh),
    math.exp: vector_exp,
    math.tanh: vector_tanh,
    np.exp: vector_exp,
    np.tanh: vector_tanh,
}

#: The same for the generated derivative of a ``score_mod`` (`elastic_np._variants.derivative`), by name.
VJP_NAMES = {"exp": vector_exp, "tanh": vector_tanh}
