"""Every use of Numba's private internals, each path on only for the tested Numba versions.

Four paths shorten a first compile (`docs/architecture.rst`, "What compiles
when", has what each buys):

``inner``
    kernel helpers compiled without Numba's Python and C wrappers and without
    machine code of their own (`inner`).
``entry_points``
    the tile primitives compiled once per dtype behind C entry points, which
    the kernels call by symbol (`symbol_call`, `register_symbol`).
``lazy_stages``
    the score-modifier and dbias stages compiled on first use, reached
    through a trampoline whose slot `ensure_lazy` fills.
``two_process_check``
    ``elastic-np check`` compiling float64 in a second process, Numba's cache
    index saved and loaded under a file lock (`locked_cache_index`).
``direct_calls``
    a small call's kernels called through their compiled entry points, not
    their dispatchers (`direct_call`): the same code, microseconds sooner.

Each path is on when the installed Numba is in `TESTED_NUMBA` and the
environment variable ``ELASTIC_NP_PUBLIC_NUMBA`` (read once, at import) does
not turn it off: ``1`` turns every path off, a comma-separated list of path
names only those. Off, the kernels compile through public Numba alone
(``njit``, called directly), with the same results and a slower first call.
The two compile the same functions to other code, which the other cannot
run (Numba's cache keys do not tell them apart): with any path off, the
kernels are cached in a folder of that setting's own (`own_cache`), so no
setting loads another's code.
"""

import contextlib
import ctypes
import os
import re
import tempfile
import threading

import numba
import numpy as np
from llvmlite import binding, ir
from numba import cfunc, njit, types
from numba.extending import intrinsic

#: The Numba versions the private paths are tested with, lowest and highest (inclusive): 0.62.1 and 0.68.1.
TESTED_NUMBA = ((0, 62, 1), (0, 68, 1))

#: The paths that `enabled` knows.
PATHS = ("inner", "entry_points", "lazy_stages", "two_process_check", "direct_calls")
#: The paths that change the compiled code (and so have caches of their own).
_COMPILING = PATHS[:4]

#: The environment variable that turns paths off (``1``: all of them).
ENV_VAR = "ELASTIC_NP_PUBLIC_NUMBA"


def _version(text):
    """``"0.68.1rc1"`` -> ``(0, 68, 1)``: the leading numbers of a version string."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return ()
    return tuple(int(n or 0) for n in match.groups())


def paths_on(version, setting):
    """The paths on for Numba ``version`` (a string) and the value ``setting`` of `ENV_VAR` (None if unset).

    Returns
    -------
    frozenset of str
        All of `PATHS` inside `TESTED_NUMBA` when ``setting`` turns none off;
        empty outside it.
    """
    low, high = TESTED_NUMBA
    if not low <= _version(version) <= high:
        return frozenset()
    setting = (setting or "").strip()
    if setting in ("", "0"):
        return frozenset(PATHS)
    if setting == "1":
        return frozenset()
    off = {name.strip() for name in setting.split(",") if name.strip()}
    unknown = off - set(PATHS)
    if unknown:
        raise ValueError(f"{ENV_VAR}={setting!r}: no path {sorted(unknown)}; use 1 or some of {PATHS}")
    return frozenset(PATHS) - off


_ON = paths_on(numba.__version__, os.environ.get(ENV_VAR))


def enabled(path):
    """Whether private path ``path`` (one of `PATHS`) is on in this process."""
    if path not in PATHS:
        raise ValueError(f"no private path {path!r}")
    return path in _ON


def direct_call(dispatcher, args):
    """``dispatcher``'s compiled entry point for the Numba types of ``args``, to call with arguments of those
    types: without the dispatcher's typing of every argument on each call (about 3 us for a kernel's tuples
    of arrays). The dispatcher itself where no such overload is compiled yet, or with ``direct_calls`` off.

    Looked up by a fingerprint of the arguments' types (`_fingerprint`, a few microseconds), the types
    themselves found once per fingerprint (Numba's ``typeof`` costs about 15 us an array).
    """
    if "direct_calls" not in _ON:
        return dispatcher
    key = (dispatcher, _fingerprint(args))
    entry = _DIRECT.get(key)
    if entry is None:
        overload = dispatcher.overloads.get(tuple(dispatcher.typeof_pyval(a) for a in args))
        if overload is None:
            return dispatcher
        entry = _DIRECT[key] = overload.entry_point
    return entry


#: `direct_call`'s entry points, by dispatcher and `_fingerprint`.
_DIRECT = {}


def _fingerprint(x):
    """What Numba's type of ``x`` depends on, for the kernels' arguments: an array's dtype, dimensions and
    flags, a tuple's class and items, a scalar's class."""
    kind = type(x)
    if kind is np.ndarray:
        flags = x.flags
        return x.dtype, x.ndim, flags.c_contiguous, flags.f_contiguous, flags.writeable, flags.aligned
    if isinstance(x, tuple):
        return (kind, *map(_fingerprint, x))
    return kind


# ---------------------------------------------------------------------------
# a Numba cache folder per setting
# ---------------------------------------------------------------------------


def cache_name(on):
    """The name of the cache folder of the paths ``on``; None with all of them on (Numba's usual places).

    ``elastic_np-public`` with every path off, else ``elastic_np-public-<the paths off>``.
    """
    off = [name for name in _COMPILING if name not in on]
    if not off:
        return None
    return "elastic_np-public" if len(off) == len(_COMPILING) else "elastic_np-public-" + "-".join(off)


def _writable(folder):
    """Whether ``folder`` exists, or can be made, and takes a new file."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def _cache_folder(name):
    """`cache_folder` for a setting named ``name`` (`cache_name`), None for None."""
    if name is None:
        return None
    if numba.config.CACHE_DIR:  # NUMBA_CACHE_DIR: its other entries are all-paths-on code
        bases = [numba.config.CACHE_DIR]
    else:  # elastic_np/cpu/__pycache__, else the user's cache folder
        package = os.path.dirname(os.path.dirname(__file__))
        bases = [os.path.join(package, "__pycache__"), os.path.expanduser("~/.cache")]
    for base in bases:
        if _writable(os.path.join(base, name)):
            return os.path.join(base, name)
    return tempfile.mkdtemp(prefix=name + "-")  # this process's alone: never a folder another setting uses


_FOLDER = []  # [cache_folder()], once found


def cache_folder():
    """This process's Numba cache folder for the package, or None with every path on (Numba's usual places).

    ``<NUMBA_CACHE_DIR>/<cache_name>`` when the variable is set, else
    ``<cache_name>`` in the package's ``__pycache__`` or in ``~/.cache``,
    the first that can be written; a new temporary folder when none can.
    """
    if not _FOLDER:
        _FOLDER.append(_cache_folder(cache_name(_ON)))
    return _FOLDER[0]


@contextlib.contextmanager
def own_cache():
    """Within the block, functions made with ``cache=True`` are cached in `cache_folder` (when not None).

    Numba picks a function's cache folder when the function is made (the
    decorator), from ``numba.config.CACHE_DIR`` (``NUMBA_CACHE_DIR``) among
    others: the package makes its kernels in this block, and the setting is
    restored after it, so that other Numba code keeps its usual cache.
    """
    folder = cache_folder()
    if folder is None:
        yield
        return
    saved = numba.config.CACHE_DIR
    numba.config.CACHE_DIR = folder
    try:
        yield
    finally:
        numba.config.CACHE_DIR = saved


def cached_cfunc(signature, body):
    """``numba.cfunc(signature, cache=True, fastmath=False)(body)``, cached in `own_cache`'s folder."""
    with own_cache():
        return cfunc(signature, cache=True, fastmath=False)(body)


# ---------------------------------------------------------------------------
# inner: helpers without wrappers or machine code
# ---------------------------------------------------------------------------


def _linked_library():
    """The class of a helper's code library (`_wrapperless`)."""
    from numba.core.codegen import JITCodeLibrary

    class LinkedLibrary(JITCodeLibrary):
        """A helper's code library: optimised LLVM IR for its callers to link, never machine code.

        Numba turns each library into machine code when it is finalised, and
        caches that object code. A helper's code only ever runs inside its
        callers' machine code, so its own is skipped, and its cache entry is
        its bitcode (which Numba turns into machine code when it loads it:
        only a process that compiles a new caller loads a helper).
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

    return LinkedLibrary


def _wrapperless():
    """`inner`'s private version: ``(decorator, dispatcher class)``, Numba's internals imported here only."""
    from numba import _dynfunc
    from numba.core import compiler
    from numba.core.registry import CPUDispatcher

    LinkedLibrary = _linked_library()

    def no_executable(library, fndesc, env):
        """The overload's Python object, with no code behind it (in place of the target's ``get_executable``)."""
        doc = f"helper {fndesc.qualname!r}, only callable from compiled code"
        return _dynfunc.make_function(fndesc.lookup_module(), fndesc.qualname.split(".")[-1], doc, 0, env,
                                      (library,))

    class InnerCompiler(compiler.Compiler):
        """Numba's compiler, lowering into a `LinkedLibrary`."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.state.targetctx.get_executable = no_executable  # this compile's own copy of the context

        def compile_extra(self, func):
            self.state.library = LinkedLibrary(self.state.targetctx.codegen(), func.__qualname__)
            return super().compile_extra(func)

    class Inner(CPUDispatcher):
        """A dispatcher that compiled code calls; Python may not (it has no wrapper to call)."""

        def __call__(self, *args, **kwargs):
            raise TypeError(f"`{self.py_func.__qualname__}` is only callable from compiled code")

    def inner(*, fastmath, **options):
        def wrap(fn):
            targetoptions = dict(options, nopython=True, fastmath=fastmath,
                                 no_cpython_wrapper=True, no_cfunc_wrapper=True)
            dispatcher = Inner(py_func=fn, locals={}, targetoptions=targetoptions, pipeline_class=InnerCompiler)
            dispatcher._cache = _inner_cache_class(LinkedLibrary, no_executable)(fn)  # enable_caching's, rebuilt as compiled
            return dispatcher

        return wrap

    return inner, Inner


def _inner_cache_class(LinkedLibrary, no_executable):
    """The cache of `inner`'s helpers: what it loads is rebuilt as a fresh compile leaves it.

    Numba rebuilds a cached function's library with the codegen's own class,
    which turns it into machine code: code generation rewrites the module in
    place (CodeGenPrepare), and the callers compiled afterwards would link
    that rewritten IR. A kernel compiled against a loaded helper would then
    differ in its last bits from the same kernel compiled against a fresh
    one, so two kernels that give the same bits when compiled in one process
    (a decode call over every sequence and one per sequence) would not when
    one of them is compiled in a process that has loaded the helpers. Here a
    loaded helper is a `LinkedLibrary` holding its cached bitcode untouched,
    with no machine code, exactly as `inner` compiles it.
    """
    from numba.core.caching import CompileResultCacheImpl, FunctionCache

    class Codegen:
        """The target's codegen, but a helper's cached bitcode comes back as a `LinkedLibrary`."""

        def __init__(self, codegen):
            self._codegen = codegen

        def unserialize_library(self, state):
            name, kind, data = state
            if kind != "bitcode":  # what `LinkedLibrary` saves is bitcode
                return self._codegen.unserialize_library(state)
            library = LinkedLibrary(self, name)
            library._final_module = binding.parse_bitcode(data)
            library._finalize_final_module()
            return library

        def set_env(self, env_name, env):
            """Numba's, for an environment the engine holds; a helper's own is never in it (nor when compiled)."""
            if self._codegen._engine.get_global_value_address(env_name):
                self._codegen.set_env(env_name, env)

        def __getattr__(self, name):
            return getattr(self._codegen, name)

    class InnerCacheImpl(CompileResultCacheImpl):
        def rebuild(self, target_context, payload):
            context = target_context.subtarget()
            codegen = Codegen(target_context.codegen())
            context.codegen = lambda: codegen
            context.get_executable = no_executable
            return super().rebuild(context, payload)

    class InnerCache(FunctionCache):
        _impl_class = InnerCacheImpl

    return InnerCache


def _public_inner(*, fastmath, **options):
    return njit(cache=True, fastmath=fastmath, **options)


#: The dispatcher class of `inner`'s helpers (None when the path is off: they are plain ``njit``).
_Inner = None
if enabled("inner"):
    _inner, _Inner = _wrapperless()
else:
    _inner = _public_inner


def inner(*, fastmath, **options):
    """Decorator for the kernel helpers, which only compiled code calls.

    On: ``njit(cache=True, fastmath=fastmath, **options)`` without the Python
    and C wrappers or machine code of its own (its callers link its optimised
    IR; it is cached as bitcode; a call from Python raises ``TypeError``).
    Off: exactly that ``njit``.
    """
    return _inner(fastmath=fastmath, **options)


# ---------------------------------------------------------------------------
# entry_points and lazy_stages: calls by symbol
# ---------------------------------------------------------------------------

_LINKED = set()  # symbols registered with LLVM


def register_symbol(symbol, address):
    """Make ``symbol`` resolve to ``address`` in code compiled or loaded from now on (once per symbol)."""
    if symbol not in _LINKED:
        binding.add_symbol(symbol, address)
        _LINKED.add(symbol)


def linked(symbol):
    """Whether `register_symbol` has made ``symbol`` resolve already."""
    return symbol in _LINKED


def flattens(ty):
    """Whether `_flatten` describes a value of type ``ty`` exactly: no array in it but C-contiguous ones.

    A strided array's pointer and shape do not say where its entries are:
    the typers of the calls by symbol refuse one (a typing error).
    """
    if isinstance(ty, types.Array):
        return ty.layout == "C"
    if isinstance(ty, types.BaseTuple):
        return all(flattens(t) for t in ty)
    return True


def _flatten(context, builder, ty, value):
    """An argument as an entry point takes it: arrays as pointer and sizes, tuples item by item,
    floats as doubles, the rest as intp."""
    from numba.core import cgutils

    if isinstance(ty, types.Array):
        if ty.layout != "C":  # typers refuse it first (`flattens`): never a misread array
            raise TypeError(f"an entry point takes C-contiguous arrays, not {ty}")
        array = context.make_array(ty)(context, builder, value)
        return [array.data] + cgutils.unpack_tuple(builder, array.shape, ty.ndim)
    if isinstance(ty, types.BaseTuple):
        return [v for i, t in enumerate(ty) for v in _flatten(context, builder, t, builder.extract_value(value, i))]
    if isinstance(ty, types.Float):
        return [context.cast(builder, value, ty, types.float64)]
    return [context.cast(builder, value, ty, types.intp)]


def call_codegen(symbol, arrange=None):
    """Intrinsic code that calls ``symbol(dtype)`` with the arguments flattened (`_flatten`).

    ``symbol`` maps the first array argument's dtype to the name; ``arrange(builder,
    values)``, when given, turns the flattened values into the entry point's
    arguments (a shared entry point's extra flags).
    """
    from numba.core import cgutils

    def codegen(context, builder, sig, args):
        values = [v for ty, value in zip(sig.args, args) for v in _flatten(context, builder, ty, value)]
        if arrange is not None:
            values = arrange(builder, values)
        dtype = next(ty.dtype for ty in sig.args if isinstance(ty, types.Array))
        fnty = ir.FunctionType(ir.VoidType(), [value.type for value in values])
        fn = cgutils.get_or_insert_function(builder.module, fnty, symbol(dtype))
        builder.call(fn, values)
        return context.get_dummy_value()

    return codegen


def symbol_call(symbol, signatures, arrange=None):
    """Intrinsic that calls ``symbol(dtype)`` (`call_codegen`) with the arguments of a typed function.

    ``signatures`` maps a dtype to the typed function's signature (its
    first argument an array of that dtype): a call whose arguments do not
    convert to it, a strided array among them, is a typing error, as when
    the typed function is called directly.
    """
    codegen = call_codegen(symbol, arrange)
    arity = len(next(iter(signatures.values())).args)

    def signature(typingctx, *args):
        """``(signature, codegen)`` for a call with types ``args``, None (no match) when they do not convert."""
        wanted = signatures.get(args[0].dtype) if isinstance(args[0], types.Array) else None
        if wanted is None or len(args) != len(wanted.args):
            return None
        # a strided array does not convert to a C-contiguous one
        if not all(typingctx.can_convert(ty, want) is not None for ty, want in zip(args, wanted.args)):
            return None
        return types.void(*args), codegen

    # an intrinsic's typer takes its arguments by name (no *args)
    if arity == 3:
        def typer(typingctx, x, m, n):
            return signature(typingctx, x, m, n)
    elif arity == 6:
        def typer(typingctx, x, m, n, shift, nvm, sums):
            return signature(typingctx, x, m, n, shift, nvm, sums)
    elif arity == 9:
        def typer(typingctx, a, a_col, b, b_col, c, m, n, k, accumulate):
            return signature(typingctx, a, a_col, b, b_col, c, m, n, k, accumulate)
    elif arity == 11:
        def typer(typingctx, a, a_col, b, b_col, c, m, n, k, col_max, nonneg, accumulate):
            return signature(typingctx, a, a_col, b, b_col, c, m, n, k, col_max, nonneg, accumulate)
    else:
        raise ValueError(f"no typer for a tile function of {arity} arguments")
    return intrinsic(prefer_literal=False)(typer)


_TRAMPOLINES = {}  # symbol -> (execution engine, address of the code, address of the slot)
_TRAMPOLINE_LOCK = threading.Lock()


def trampoline(symbol, signature):
    """``(code, slot)`` addresses: code for ``symbol`` (C ``signature``) that jumps to the address in the slot."""
    with _TRAMPOLINE_LOCK:  # compile_for and ensure_lazy may ask from two threads
        if symbol not in _TRAMPOLINES:
            _TRAMPOLINES[symbol] = _build_trampoline(signature)
    return _TRAMPOLINES[symbol][1:]


def _build_trampoline(signature):
    """``(engine, code address, slot address)`` of a new trampoline for ``signature``."""
    kinds = [
        "double" if ty == types.float64 else "ptr" if isinstance(ty, types.CPointer) else "i64"
        for ty in signature.args
    ]
    params = ", ".join(f"{kind} %a{n}" for n, kind in enumerate(kinds))
    text = (
        "@slot = global ptr null\n"
        f"define void @jump({params}) {{\n"
        "  %f = load ptr, ptr @slot\n"
        f"  call void %f({params})\n"
        "  ret void\n}\n"
    )
    module = binding.parse_assembly(text)
    module.triple = binding.get_process_triple()
    machine = binding.Target.from_triple(module.triple).create_target_machine()
    engine = binding.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    return engine, engine.get_function_address("jump"), engine.get_global_value_address("slot")


_LAZY = {}  # symbol -> the compiled entry point (kept alive: its address is in the slot)
_LAZY_LOCK = threading.Lock()


def ensure_lazy(symbol, signature, body):
    """Compile (or load from the cache) ``body`` as a `numba.cfunc` of ``signature``; fill ``symbol``'s slot."""
    if symbol in _LAZY:
        return
    with _LAZY_LOCK:
        if symbol not in _LAZY:
            entry = cached_cfunc(signature, body)
            ctypes.c_void_p.from_address(trampoline(symbol, signature)[1]).value = entry.address
            _LAZY[symbol] = entry


# ---------------------------------------------------------------------------
# two_process_check: Numba's cache index under a file lock
# ---------------------------------------------------------------------------

#: The lock file `locked_cache_index` leaves in each Numba cache folder it writes to.
LOCK_NAME = ".elastic_np.lock"


@contextlib.contextmanager
def locked_cache_index():
    """Within the block, this process saves and loads Numba cache entries under an exclusive file lock.

    The lock is the file `LOCK_NAME` in the cache folder of the function's
    module, taken with ``fcntl.flock`` around Numba's own save and load.
    """
    import fcntl

    from numba.core.caching import IndexDataCacheFile

    save, load = IndexDataCacheFile.save, IndexDataCacheFile.load

    @contextlib.contextmanager
    def lock(cache_file):
        try:
            handle = open(os.path.join(cache_file._cache_path, LOCK_NAME), "a")
        except OSError:  # no cache folder yet (nothing to load) or none writable: as Numba does
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield

    def locked_save(self, key, data):
        with lock(self):
            return save(self, key, data)

    def locked_load(self, key):
        with lock(self):
            return load(self, key)

    IndexDataCacheFile.save, IndexDataCacheFile.load = locked_save, locked_load
    try:
        yield
    finally:
        IndexDataCacheFile.save, IndexDataCacheFile.load = save, load
