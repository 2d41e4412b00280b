"""The CPU kernels' thread pool: a kernel runs as ``threads`` parts, on the pool's workers and the calling thread.

Handing work to a sleeping thread costs the time it takes to wake it, as
much as a small decode call's arithmetic (docs/performance.rst). So
a worker that has run a part waits for the next by spinning, without the
GIL, for `config.THREAD_SPIN_SECONDS` before it sleeps, and a calling thread
that has run part 0 spins for the workers' parts, for at most
`config.CALLER_SPIN_SECONDS`, before it sleeps. Each spin is bounded by the
monotonic clock, not by a count of steps: a thread that the system takes
off its core (another process wants it) spins no longer for that, and
nobody spins when the process has fewer cores than threads (the spin would
take the core another thread needs). A thread that waits for the GIL
sleeps, so each side signals the other from code that does not hold it:
the worker stores its count of finished parts after releasing it.

A long call from the main thread (`config.INTERRUPTIBLE_WORK` multiply-adds
or more, of a kernel whose threads claim their tasks) runs every part on
the workers while the calling thread sleeps, where a signal's handler runs:
when it raises (Ctrl-C's `KeyboardInterrupt`), the call's tasks are
stopped, each worker ends after the task it holds (`claim`), and the
exception goes on.
"""

import os
import platform
import threading
import time

import numba
import numba.np.ufunc.parallel as _numba_parallel
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from elastic_np.cpu._runtime import config, openmp
from elastic_np.cpu._runtime.numba_private import inner

_pool = None
_pool_lock = threading.Lock()


def _forget_pool():
    global _pool, _pool_lock
    _pool = None  # a forked child has none of the threads
    _pool_lock = threading.Lock()  # a thread of the parent may have held it


os.register_at_fork(after_in_child=_forget_pool)


def thread_count():
    """The threads the kernels run on: `numba.get_num_threads`, without starting Numba's threads.

    ``numba.get_num_threads()`` first launches Numba's threading layer, which
    may load an OpenMP runtime beside another library's (PyTorch's), and that
    slows the other library's parallel code in the same process. The kernels
    never use that layer, so until something else has launched it (as
    ``numba.set_num_threads`` does) the count is its default,
    ``numba.config.NUMBA_NUM_THREADS``, the value it would report.
    """
    if getattr(_numba_parallel, "_is_initialized", True):
        return numba.get_num_threads()
    return numba.config.NUMBA_NUM_THREADS


def run_tasks(kernel, *args, work=None, tasks=None):
    """Run ``kernel(*args, part, parts)`` for every ``part`` of ``parts`` = `thread_count` threads.

    ``tasks``: the call's `task_counter`, for a kernel whose threads claim
    their tasks from it (`claim`): then ``kernel(*args, tasks, part, parts)``,
    and a long call is interruptible (`_interruptible`). ``work``: the
    multiply-adds of the call, an estimate (of the attention call it serves,
    for a pass that prepares or sums for one); below `SERIAL_WORK`, after a
    late worker (`_late_for`), or while another Python thread's call holds
    the pool, on the calling thread alone (``parts = 1``).

    Thread ``part`` of ``parts`` runs its contiguous share of the kernel's
    tasks (`task_range`), or, in the kernels of the forward, decode,
    backward and double backward, the tasks it claims first from ``tasks``;
    the kernels release the GIL. Every task writes outputs of its own, so the
    result has the same bits for every thread count. From `QUIET_OPENMP_WORK`
    multiply-adds on, the OpenMP runtimes in the process are first asked to
    let their idle workers go (`elastic_np.cpu._runtime.openmp`). Threads instead of
    ``prange``: a parallel Numba function compiles its loop body again as a
    gufunc, which LLVM optimises once per level it is linked into: the first
    compile of these kernels would take that much longer.
    """
    if tasks is not None:
        args = (*args, tasks)
    if work is not None and work < config.SERIAL_WORK:  # below any parallel or interruptible call's work
        kernel(*args, 0, 1)
        return
    threads = thread_count()
    interruptible = _interruptible(tasks, work)
    serial = threads == 1 or (work is not None and (work < config.SERIAL_WORK or _late_for(work)))
    pool = None if serial and not interruptible else _pool_of(threads)
    if pool is None or not pool.lock.acquire(blocking=False):
        kernel(*args, 0, 1)
        return
    try:
        if pool.closed:  # replaced by a larger pool meanwhile
            kernel(*args, 0, 1)
        else:
            if work is None or work >= config.QUIET_OPENMP_WORK:
                openmp.quiet()  # their spinning workers would share the cores with the parts
            pool.run(kernel, args, threads, tasks, interruptible, work)
    finally:
        pool.lock.release()


def start_threads():
    """Start the pool of `thread_count` threads, and load its compiled helpers, as a first parallel call would."""
    threads = thread_count()
    if threads > 1:
        _pool_of(threads)


def _late_for(work):
    """Whether a worker of the pool was late for a call of at least ``work`` multiply-adds a moment ago.

    Late: it had not taken its part when the calling thread had ended its
    own (`_Pool.run`), so it added nothing but a thread to wake. For
    `config.LATE_WORKER_SECONDS` after that, calls of up to twice that work
    run on the calling thread alone: on a loaded machine (other processes
    on the cores) the woken workers would only take turns with them, and
    with the caller's neighbours (PyTorch's threads); then the pool is tried
    again.
    """
    pool = _pool
    return pool is not None and work <= pool.late_work and pool.late()


def _interruptible(tasks, work):
    """Whether a call runs its parts on the workers alone, the calling thread asleep where a signal reaches it.

    A call of `config.INTERRUPTIBLE_WORK` multiply-adds or more, from the main
    thread (the only one Python runs signal handlers in), of a kernel that
    claims its ``tasks``. A shorter call's calling thread runs a part:
    waking it after the workers' parts would cost as much as a short call's
    arithmetic.
    """
    return (tasks is not None and work is not None and work >= config.INTERRUPTIBLE_WORK
            and threading.current_thread() is threading.main_thread())


def _pool_of(workers):
    """The pool, with at least ``workers`` workers (a smaller or broken one is replaced, and closed outside the lock)."""
    global _pool
    with _pool_lock:
        old = None
        if _pool is None or _pool.size < workers or _pool.broken:
            old, _pool = _pool, _Pool(workers)
        pool = _pool
    if old is not None:
        old.close()  # waits for a call running on it, if any
    return pool


def _cores():
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


class _Pool:
    """Worker threads, each serving the parts posted to it.

    ``flags[3 w]`` counts the parts posted to worker ``w``, ``flags[3 w + 1]``
    those finished, and ``flags[3 w + 2]`` those taken: a part of a kernel
    that claims its tasks runs on whichever thread takes it first (`_take`),
    the worker when it gets to it, or the calling thread once its own part
    is done, so such a call never waits for a worker that the system has not
    given a core yet (a loaded machine).
    Either side spins on the other's count (`_spin_while`) and then sleeps
    on an event, which the other sets after each change of its count. A call
    waits until every worker has finished the parts of any earlier call (one
    interrupted, say) before it posts.
    """

    def __init__(self, size):
        self.size = size
        self.lock = threading.Lock()  # held by the call running on the pool
        self.flags = np.zeros(3 * size, dtype=np.int64)
        self.jobs = [None] * size  # (kernel, args, errors, wake): the part of the last post, until taken
        self.posted = [threading.Event() for _ in range(size)]
        self.finished = [threading.Event() for _ in range(size)]
        self.closed = False
        self.broken = False
        self.late_work, self.late_until = -1, 0.0  # see `_late_for`
        # spinning only pays when every thread that runs a part has a core: else it takes another's
        spins = _CLOCK is not None and _cores() >= size
        self.spin_ns = int(config.THREAD_SPIN_SECONDS * 1e9) if spins else 0
        self.caller_spin_ns = int(config.CALLER_SPIN_SECONDS * 1e9) if spins else 0
        # compiled (or loaded) now, not within a later call that first takes a part back
        _take(self.flags, 0, 0, 0)
        _store(self.flags, 0, 0)
        _spin_while(self.flags, 0, 1, 0, -1)
        self.threads = [threading.Thread(target=self._serve, args=(w,), name=f"elastic_np-{w}", daemon=True)
                        for w in range(size)]
        for thread in self.threads:
            thread.start()

    def run(self, kernel, args, parts, tasks=None, interruptible=False, work=None):
        """``kernel(*args, part, parts)`` for every part; raises a part's error.

        Part 0 runs on the calling thread. ``tasks``: the counter the kernel
        claims its tasks from, if it does; once a part has ended, a part no
        worker has taken yet finds none left, and runs on the calling thread
        at once (`_take_back`) rather than waiting for a worker that the
        system has not given a core. ``interruptible``: the parts are the
        workers', and the calling thread sleeps until the first ends (then
        takes back the others'): an exception that a signal's handler raises
        there stops the tasks (`stop`) and goes on once each worker has
        ended the task it held. A part taken back after the caller's own, of
        a call of ``work`` multiply-adds, makes the pool late for that work
        (`_late_for`).
        """
        first = 0 if interruptible else 1  # the first part a worker runs
        errors = [None] * (parts - first)
        posted = []
        try:
            for w in range(parts - first):
                self._post(w, (kernel, (*args, w + first, parts), errors, first == 0))
                posted.append(w)
            if first:
                kernel(*args, 0, parts)
            late = self._collect(posted, caller_ran=first == 1, claimed=tasks is not None)
        except BaseException:
            if interruptible:
                stop(tasks)
            raise
        finally:
            for w in posted:
                self._wait_finished(w, self.caller_spin_ns)
        for error in errors:
            if error is not None:
                raise error
        if late and work is not None:
            self._note_late(work)

    def _post(self, w, job):
        """Post ``job = (kernel, args, errors, wake)`` to worker ``w``, once its earlier parts have ended."""
        self._wait_finished(w, self.caller_spin_ns)  # an interrupted call's part, if any
        self.jobs[w] = job
        self.flags[3 * w] += 1
        self.posted[w].set()

    def _collect(self, posted, caller_ran, claimed):
        """Wait for the ``posted`` workers' parts, or take them back; whether one was late for the caller's part.

        In a kernel that claims its tasks (``claimed``), once a part has ended
        (the caller's, or the first worker's), a part that no worker has
        taken finds no task left and runs on the calling thread. (A share of
        another kernel's tasks would run there after the caller's own: a
        worker waking is waited for.)
        """
        late = False
        for i, w in enumerate(posted):
            if claimed and (caller_ran or i) and self._take_back(w):
                late = late or caller_ran
            else:
                self._wait_finished(w, self.caller_spin_ns if caller_ran else 0)
        return late

    def late(self):
        """Whether a worker was late a moment ago (`_late_for`)."""
        return time.monotonic() < self.late_until

    def _note_late(self, work):
        """A worker was late for a call of ``work`` multiply-adds: the next calls of up to twice that go serial."""
        now = time.monotonic()
        self.late_work = max(2 * work, self.late_work if now < self.late_until else -1)
        self.late_until = now + config.LATE_WORKER_SECONDS

    def close(self):
        """Let the workers exit, once the call running on the pool, if any, has finished."""
        with self.lock:
            self.closed = True
        for event in self.posted:
            event.set()

    def _take_back(self, w):
        """Run worker ``w``'s posted part on the calling thread if the worker has not taken it; whether it did."""
        count = int(self.flags[3 * w])
        if not _take(self.flags, 3 * w + 2, count - 1, count):
            return False
        kernel, args, _, _ = self.jobs[w]
        self.jobs[w] = None
        try:
            kernel(*args)
        finally:
            _store(self.flags, 3 * w + 1, count)
        return True

    def _wait_finished(self, w, spin_ns):
        """Wait for worker ``w``'s parts: spin up to ``spin_ns`` nanoseconds, then sleep (where signals' handlers run)."""
        posted = self.flags[3 * w]
        if self.flags[3 * w + 1] == posted:
            return
        if spin_ns:
            _spin_while(self.flags, 3 * w + 1, self.flags[3 * w + 1], spin_ns, -1)
        while self.flags[3 * w + 1] != posted:
            # woken each 0.1 s: a signal's handler runs then even where the signal went to another thread
            if not self.finished[w].wait(timeout=0.1) and not self.threads[w].is_alive():
                self.broken = True
                raise RuntimeError(f"worker {w} of the CPU kernels' thread pool has died")
            self.finished[w].clear()

    def _serve(self, w):
        seen = 0
        changed = _spin_while(self.flags, 3 * w, seen, self.spin_ns, -1)
        while True:
            if not changed:  # no part posted within the spin: sleep
                self.finished[w].set()  # for a caller that fell asleep waiting for the last part
                if self.closed:
                    return
                self.posted[w].wait()
                self.posted[w].clear()  # a set after the wait is for a count checked next
                changed = _spin_while(self.flags, 3 * w, seen, self.spin_ns, -1)
                continue
            seen = int(self.flags[3 * w])
            finished = -1  # where the spin stores the count of finished parts: nowhere if the caller took the part
            if _take(self.flags, 3 * w + 2, seen - 1, seen):
                if self._run_part(w):  # the caller sleeps: the count, then its event
                    _store(self.flags, 3 * w + 1, seen)
                    self.finished[w].set()
                else:
                    finished = 3 * w + 1
            # the count is stored without the GIL, in the spin, where the caller, seeing it, takes the GIL at once
            changed = _spin_while(self.flags, 3 * w, seen, self.spin_ns, finished)

    def _run_part(self, w):
        """Run worker ``w``'s posted part, which it has taken; whether its caller sleeps until it ends."""
        kernel, args, errors, wake = self.jobs[w]  # posted before the count
        self.jobs[w] = None
        try:
            kernel(*args)
        except BaseException as exc:  # raised by the calling thread
            errors[w] = exc
        return wake


@njit(nogil=True, cache=True, fastmath=False)
def _take(flags, i, expected, taken):
    """``flags[i] = taken`` if ``flags[i] == expected``, as one atomic step of every thread's; whether it was."""
    return _compare_exchange(flags, i, expected, taken)


@njit(nogil=True, cache=True, fastmath=False)
def _store(flags, i, value):
    """``flags[i] = value``, released to the other threads, without the GIL."""
    _write_release(flags, i, value)


#: The clock the spins read (`_monotonic_ns`); None where the platform has no ``clock_gettime``: nobody spins.
_CLOCK = getattr(time, "CLOCK_MONOTONIC", None)


@intrinsic
def _monotonic_ns(typingctx):
    """Nanoseconds of the monotonic clock (``clock_gettime``; 0 where `_CLOCK` is None)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        if _CLOCK is None:
            return ir.Constant(i64, 0)
        timespec = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))  # (seconds, nanoseconds) on LP64
        clock_gettime = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32), timespec.type]), "clock_gettime")
        builder.call(clock_gettime, [ir.Constant(ir.IntType(32), _CLOCK), timespec])
        seconds, nanoseconds = (builder.load(cgutils.gep_inbounds(builder, timespec, 0, i)) for i in (0, 1))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanoseconds)

    return types.int64(), codegen


@njit(nogil=True, cache=True, fastmath=False)
def _spin_while(flags, i, value, ns, store_at):
    """Wait, without the GIL, while ``flags[i] == value``, for at most ``ns`` nanoseconds; True if it changed.

    With ``store_at >= 0``, first ``flags[store_at] = value``. The clock is
    read every 64 spin-wait hints (a few microseconds).
    """
    if store_at >= 0:
        _write_release(flags, store_at, value)
    if ns > 0:
        deadline = _monotonic_ns() + ns
        while _monotonic_ns() < deadline:
            for _ in range(64):
                if _read_acquire(flags, i) != value:
                    return True
                _pause()
    return _read_acquire(flags, i) != value


def _is_flags(flags):
    return isinstance(flags, types.Array) and flags.dtype == types.int64 and flags.ndim == 1


def _flag_pointer(context, builder, signature, args):
    """The pointer to ``flags[i]`` of an intrinsic's first two arguments ``(flags, i)``."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(array.data, [args[1]], inbounds=True)


@intrinsic
def _read_acquire(typingctx, flags, i):
    """``flags[i]`` read anew on every call (an atomic load), which another thread's store changes."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_flag_pointer(context, builder, signature, args), "acquire", 8)

    return (types.int64(flags, types.intp), codegen) if _is_flags(flags) else None


@intrinsic
def _write_release(typingctx, flags, i, value):
    """``flags[i] = value``, an atomic store that another thread's `_read_acquire` sees."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, _flag_pointer(context, builder, signature, args), "release", 8)
        return context.get_dummy_value()

    return (types.void(flags, types.intp, value), codegen) if _is_flags(flags) else None


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@intrinsic
def _pause(typingctx):
    """The CPU's spin-wait hint (``pause`` on x86; nothing elsewhere)."""

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


def task_counter():
    """A call's counter of claimed tasks, for a kernel that takes them as its threads get to them (`claim`).

    ``[claimed, stopped]``: the tasks claimed so far, and 1 once the call is
    stopped (`stop`).
    """
    return np.zeros(2, dtype=np.int64)


def stop(tasks):
    """Stop a call's tasks: every later `claim` of its threads finds none left."""
    tasks[1] = 1


#: What `claim` returns once a call's tasks are stopped: above the tasks of any call.
_STOPPED = 1 << 62


@inner(fastmath=False)
def claim(tasks):
    """The next unclaimed task of a call's `task_counter`, claimed: each task goes to the first thread that asks.

    A kernel's loop ``for _ in range(n): task = claim(tasks); if task >= n: break``
    keeps every thread busy until no task is left, however much slower one
    thread runs than another (another process on its core, a slower core);
    each thread's tasks still rise. Each task writes outputs of its own, so
    which thread runs it changes no bits. Once the call is stopped (`stop`),
    none is left.
    """
    if _read_acquire(tasks, 1) != 0:
        return _STOPPED
    return _fetch_add(tasks, 0, 1)


@intrinsic
def _compare_exchange(typingctx, flags, i, expected, new):
    """``flags[i] = new`` if ``flags[i] == expected``, as one atomic step of every thread's; whether it was."""
    def codegen(context, builder, signature, args):
        expected, new = (context.cast(builder, args[k], signature.args[k], types.int64) for k in (2, 3))
        pair = builder.cmpxchg(_flag_pointer(context, builder, signature, args), expected, new, "acq_rel", "acquire")
        return builder.extract_value(pair, 1)

    return (types.boolean(flags, types.intp, expected, new), codegen) if _is_flags(flags) else None


@intrinsic
def _fetch_add(typingctx, flags, i, value):
    """``flags[i] += value`` as one atomic step of every thread's; the value before."""
    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", _flag_pointer(context, builder, signature, args), value, "monotonic")

    return (types.int64(flags, types.intp, value), codegen) if _is_flags(flags) else None


@inner(fastmath=False)
def task_range(n, part, parts):
    """The tasks of thread ``part`` of ``parts``: a contiguous share of ``range(n)``.

    Contiguous, as ``prange`` schedules them: consecutive tasks alternate a
    cheap and a costly tile under a causal mask (`zigzag`), so any run of
    them is balanced, where every ``parts``-th task would not be (with two
    threads, one would get every cheap tile).
    """
    return range(n * part // parts, n * (part + 1) // parts)


@inner(fastmath=False)
def query_tile(task, n_qt, H, group, block_q, N):
    """``(b, h, hk, qt, i0, bq)`` of a task of the kernels with one task per (batch, head, query tile).

    Batch entry, head, its kv head, the query tile (tiles taken in `zigzag`'s
    order within a head), its first query and its queries.
    """
    bh = task // n_qt
    b, h = bh // H, bh % H
    qt = zigzag(task % n_qt, n_qt)
    i0 = qt * block_q
    return b, h, h // group, qt, i0, min(block_q, N - i0)


@inner(fastmath=False)
def zigzag(t, n):
    """Visit tiles 0, n-1, 1, n-2, ...: cheap and costly causal tiles alternate."""
    return t // 2 if t % 2 == 0 else n - 1 - t // 2
