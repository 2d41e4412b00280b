"""Every tunable of the CPU kernels, in one place.

Host code reads them as ``config.NAME`` at call time, so a test may set one
with ``monkeypatch.setattr(elastic_np.cpu._runtime.config, NAME, value)``.
What is derived from them and kept (the decode schedules, a plan's kernel
launches) is kept per `GENERATION`, which every such setting counts.
"""

import sys
import types


class _Config(types.ModuleType):
    """This module: setting a value at run time counts a `GENERATION`."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name != "GENERATION":
            super().__setattr__("GENERATION", self.GENERATION + 1)


#: How many times a value was set at run time: what is kept from them is kept per generation.
GENERATION = 0

# Prefill tiles (`elastic_np.cpu._prefill.forward`, `elastic_np.cpu._prefill.backward`)

#: Queries per tile (the vector axis of every tile) and keys per tile.
BLOCK_Q = 128
BLOCK_K = 128
#: The backward's key tiles (and the double backward's key pass's) are this
#: many times BLOCK_K long: every key tile reads all the query-side tiles (q,
#: dout, both layouts) once, so longer key tiles halve that traffic and the dq shares.
BACKWARD_K_FACTOR = 2
#: Memory for the backward's per-key-tile shares of dq (chunks of key tiles beyond it).
DQ_SHARES_BYTES = 1 << 25
#: Memory for the backward's float64 partials of a broadcast bias's gradient.
DBIAS_PARTIALS_BYTES = 1 << 25
#: Tasks the backward aims at when a broadcast bias folds (batch, kv head) pairs into lanes.
DBIAS_MIN_TASKS = 64

#: Whether a bfloat16 prefill forward runs its products on AMX tiles where the CPU has them
#: (`elastic_np.cpu._prefill.forward_amx`); False: the float32 products, as on every other CPU.
AMX = True

# Decoding (`elastic_np.cpu._decode.decode`)

#: Queries per sequence up to which `elastic_np.cpu.forward` takes the decode kernel.
DECODE_MAX_QUERIES = 16
#: Stacked rows (query heads of a group x queries) up to which it does.
DECODE_MAX_ROWS = 128
#: Queries per sequence from which the key-major kernel decodes (each head a
#: prefill tile of its queries: a multiple of the float32 vector fills its
#: registers), below which the stacked-rows kernel does.
DECODE_KEY_MAJOR_QUERIES = 16
#: Keys per tile (see `elastic_np.cpu._decode.plan.block_keys`).
DECODE_BLOCK_K = 256
#: Stacked rows up to which a tile holds half of `DECODE_BLOCK_K` keys.
DECODE_FEW_ROWS = 16
#: Tasks the keys are split into when there are fewer (batch, kv head) pairs.
DECODE_MIN_TASKS = 32
#: Fewest keys of a split.
DECODE_MIN_SPLIT_KEYS = 512
#: Keys ahead of those it reads that the stacked-rows kernel hints into the
#: cache (`elastic_np.cpu._decode.products`); a whole number of pages in a
#: paged cache.
DECODE_HINT_KEYS = 128
#: Where a task reads its tiles run by run (`elastic_np.cpu._decode.plan.tile_reads`):
#: the longest run, and the keys ahead that each kv head hints.
DECODE_RUN_KEYS = 32
DECODE_RUN_HINT_KEYS = 32

# Threads (`elastic_np.cpu._runtime.threads`)

#: Multiply-adds below which a call runs on the calling thread: handing work to
#: the pool and waiting for it costs about as much as this much arithmetic.
SERIAL_WORK = 1 << 21
#: Seconds a worker of the pool spins, without the GIL, waiting for its next
#: part before it sleeps: a few times what waking a sleeping thread costs
#: (docs/performance.rst).
THREAD_SPIN_SECONDS = 3e-4
#: Seconds at most a calling thread that has run its part spins, without the
#: GIL, for the workers' parts before it sleeps: their parts end within a task
#: of its own (the tasks are claimed), which below `INTERRUPTIBLE_WORK` is short.
CALLER_SPIN_SECONDS = 2e-3
#: Multiply-adds from which a call from the main thread runs all its parts on
#: the pool's workers while the calling thread sleeps, where a signal (Ctrl-C)
#: reaches it and stops the call's tasks (`elastic_np.cpu._runtime.threads`):
#: far more arithmetic than the hand-off costs (docs/performance.rst); a
#: shorter call ends before Ctrl-C is missed.
INTERRUPTIBLE_WORK = 1 << 32
#: Seconds for which calls of up to twice the work of a call a worker was late
#: for run on the calling thread alone (`elastic_np.cpu._runtime.threads._late_for`):
#: on a loaded machine the pool is tried again this often.
LATE_WORKER_SECONDS = 0.5
#: Multiply-adds from which a call that runs on the pool first asks the OpenMP
#: runtimes in the process (PyTorch's) to let their idle workers go
#: (`elastic_np.cpu._runtime.openmp`): they spin for milliseconds after each of their
#: parallel regions, on the cores the parts need. Where they sleep already,
#: asking, and the library starting its threads again, is pure cost: below this
#: it would cost more than it can save (docs/performance.rst). ``math.inf``: never.
QUIET_OPENMP_WORK = 1 << 23

# Compiler flags of the kernels' tile code. Reassociation lets LLVM vectorise
# the row sums; no flag that assumes finite values, since -inf marks every
# removed entry. Numba compiles a function that sets no `fastmath` with the
# flags of whatever compiles it first (a kernel's, or none from Python), and
# keeps that version: the kernels' bits would depend on the order things are
# compiled in. Every njit function of the package states its own: FASTMATH
# for the forward's tile code, False elsewhere.
FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


sys.modules[__name__].__class__ = _Config
