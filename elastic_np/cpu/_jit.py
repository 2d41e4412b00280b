"""`inner`: how the CPU backend jits a function that only compiled code calls.

Numba gives every jitted function two wrappers, one for Python callers
(which unboxes every argument: every field of the options record) and one
C-callable, and optimises and generates machine code for them with the
function. A helper inside a kernel needs neither: its callers call it from
compiled code and link its LLVM code into their own module, which they
optimise and turn into machine code themselves. Built without the wrappers,
and without machine code of its own (`_LinkedLibrary`), a helper's compile
is its own code alone, optimised once for its callers; its Python entry
raises.
"""

from numba import _dynfunc
from numba.core import compiler
from numba.core.codegen import JITCodeLibrary
from numba.core.registry import CPUDispatcher


class _LinkedLibrary(JITCodeLibrary):
    """A helper's code library: optimised LLVM IR for its callers to link, never machine code.

    Numba turns each library into machine code when it is finalised, and
    caches that object code. A helper's code only ever runs inside its
    callers' machine code, so its own is skipped, and its cache entry is its
    bitcode (which Numba turns into machine code when it loads it: only a
    process that compiles a new caller loads a helper).
    """

    def _finalize_final_module(self):
        # The checks Numba runs before generating machine code, and nothing after.
        self._finalize_dynamic_globals()
        self._verify_declare_only_symbols()
        self._finalized = True

    def get_pointer_to_function(self, name):
        """0, Numba's answer for a symbol the library does not define: no code of a helper runs alone."""
        self._ensure_finalized()
        return 0

    def serialize_using_object_code(self):
        return self.serialize_using_bitcode()


def _no_executable(library, fndesc, env):
    """The overload's Python object, with no code behind it (a helper has no wrapper to point at).

    In place of the target's ``get_executable``, which would also point the
    function's environment at ``env`` in machine code the helper does not have.
    """
    doc = f"helper {fndesc.qualname!r}, only callable from compiled code"
    return _dynfunc.make_function(fndesc.lookup_module(), fndesc.qualname.split(".")[-1], doc, 0, env, (library,))


class _InnerCompiler(compiler.Compiler):
    """Numba's compiler, lowering into a `_LinkedLibrary`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state.targetctx.get_executable = _no_executable  # this compile's own copy of the context

    def compile_extra(self, func):
        self.state.library = _LinkedLibrary(self.state.targetctx.codegen(), func.__qualname__)
        return super().compile_extra(func)


class _Inner(CPUDispatcher):
    """A dispatcher that compiled code calls; Python may not (it has no wrapper to call)."""

    def __call__(self, *args, **kwargs):
        raise TypeError(f"`{self.py_func.__qualname__}` is only callable from compiled code")


def inner(*, fastmath, **options):
    """``njit(cache=True, fastmath=fastmath, **options)`` without the Python and C wrappers or machine code.

    For the helpers of the kernels, which only compiled code calls.
    """

    def wrap(fn):
        targetoptions = dict(options, nopython=True, fastmath=fastmath,
                             no_cpython_wrapper=True, no_cfunc_wrapper=True)
        dispatcher = _Inner(py_func=fn, locals={}, targetoptions=targetoptions, pipeline_class=_InnerCompiler)
        dispatcher.enable_caching()
        return dispatcher

    return wrap
