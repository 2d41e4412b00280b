"""`inner`: how the CPU backend jits a function that only compiled code calls.

Numba gives every jitted function two wrappers, one for Python callers
(which unboxes every argument: every field of the options record) and one
C-callable, and optimises and generates machine code for them with the
function. A helper inside a kernel needs neither: its callers call it from
compiled code and link its LLVM code into their own module. Built without
them, a helper's compile is its own code alone; its Python entry raises.
"""

from numba.core.registry import CPUDispatcher


class _Inner(CPUDispatcher):
    """A dispatcher that compiled code calls; Python may not (it has no wrapper to call)."""

    def __call__(self, *args, **kwargs):
        raise TypeError(f"`{self.py_func.__qualname__}` is only callable from compiled code")


def inner(*, fastmath, **options):
    """``njit(cache=True, fastmath=fastmath, **options)`` without the Python and C wrappers.

    For the helpers of the kernels, which only compiled code calls.
    """

    def wrap(fn):
        targetoptions = dict(options, nopython=True, fastmath=fastmath,
                             no_cpython_wrapper=True, no_cfunc_wrapper=True)
        dispatcher = _Inner(py_func=fn, locals={}, targetoptions=targetoptions)
        dispatcher.enable_caching()
        return dispatcher

    return wrap
