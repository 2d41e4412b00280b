"""The numba.cuda backend: tiled attention kernels, forward and backward.

Selected with ``backend="cuda"`` (or ``"auto"`` when a GPU is usable). The
package's modules, each kernel family's kernels beside its host code (as
FlashAttention's ``hopper/`` keeps ``flash_fwd_kernel`` beside
``flash_fwd_launch_template``):

- the three families, a kernel module (imports ``numba.cuda``, imported on
  first use) and its ``_launch`` sibling (imports no ``numba.cuda``: tile
  sizes or geometry, shared-memory sizing, the launch):
  `elastic_np.cuda._forward` and `elastic_np.cuda._forward_launch` (the
  flash forward; its tensor-core kernels in `elastic_np.cuda._forward_tc`),
  `elastic_np.cuda._decode` and
  `elastic_np.cuda._decode_launch` (decoding: when it runs, stacked rows,
  key splits, the merge), `elastic_np.cuda._backward` and
  `elastic_np.cuda._backward_launch` (``delta``, ``dq``, ``dk``, ``dv``, a
  broadcast bias's ``dbias``; on the tensor cores, with ``TC_BACKWARD``,
  `elastic_np.cuda._backward_tc`);
- what the families share: on the host, `elastic_np.cuda._api` (the entry
  points `forward` and `backward`, which pick decode or prefill, and the
  option arrays every kernel takes: the window and gate bands, the bias
  operand) and `elastic_np.cuda._host` (``numba.cuda`` and the kernel modules
  on first use, availability, device arrays, validation, the shared-memory
  limit); on the device, the device functions of `elastic_np.cuda._device`;
- `elastic_np.cuda._config` (the tunables), `elastic_np.cuda._compile` (PTX
  and the resource report, without a GPU), every kernel by name and their
  conventions in `elastic_np.cuda._kernels`, and the simulator's missing warp
  shuffles in `elastic_np.cuda._sim`.

Importing `elastic_np` never imports this package; importing this package
never imports ``numba.cuda``. The GPU benchmark and ``python -m
elastic_np.cuda`` are tools (`elastic_np.cli._cuda_bench`,
`elastic_np.cli._cuda`); this package imports neither.

Design
------
Forward (``_forward_kernel``): a flash kernel with register micro-tiles. One
block per (batch * head, query tile of ``FORWARD_BLOCK_Q`` rows); the block's
threads form row groups of ``tpr = FORWARD_BLOCK_K / REG_N`` consecutive
lanes of one warp, each thread owning ``REG_M`` query rows. Per K/V tile of
``FORWARD_BLOCK_K`` keys (staged in shared memory, K then V in the same
buffer): each thread computes a ``REG_M x REG_N`` micro-tile of dot products
in registers (``REG_M + REG_N`` shared loads per ``REG_M REG_N``
multiply-adds, loops fully unrolled), the score pipeline turns them into
logits (written once, `elastic_np.cuda._device._entry`, shared with the
backward kernels), the row max is combined across the row group with warp
shuffles (``shfl_xor_sync``), the running sums and the ``REG_M x ACC_COLS``
output accumulator are rescaled in registers, and ``p`` goes through shared
memory to the ``p V`` micro-tile product. Each thread's running max and
partial row sum, and the rescale factor, sit in shared memory (one slot per
thread and row) rather than in local arrays: the score pipeline is long, so
its loop over the rows is not unrolled, and a local array indexed by a loop
counter would live in local memory. Only the key tiles that the causal,
window, ``kv_lengths`` and dynamic-window band can reach are visited. A
value head wider than ``tpr * ACC_COLS`` takes several passes over the keys
(each recomputing the same scores, hence the same softmax). The row sums are
combined in a fixed butterfly, so results are bit-identical from run to run.
``out = (acc num) / den`` (`elastic_np.cuda._device._finish_row`): one
rounding, not two through a reciprocal. ``elastic_np.cuda.resources()``
reports each kernel's registers, local memory and spills from the compiled
code (see the performance page).

Decoding (1 to ``DECODE_MAX_QUERIES`` queries per sequence,
`elastic_np.cuda._decode`): the query heads of a GQA group are stacked so
that each K/V tile staged in shared memory serves all of them; the keys are
split across blocks (split-KV) when the (batch, kv head) blocks alone are too
few to fill the GPU, the number of splits depending on the shape and the
config only; a second kernel merges the partial ``(max, sum, acc)`` in split
order and adds ``beta`` once. Same bits on every run.

Backward (`elastic_np.cuda._backward`), FlashAttention-2 partitioning,
recomputing the probabilities from ``lse``:

- ``delta = dout . out - dlse`` per row (``dlse``, the cotangent of ``lse``,
  zeros when none is given): ``_backward_delta_kernel``, first.
- ``dk``, ``dv``: ``_backward_dkdv_kernel``, one block per (batch * kv head,
  key tile), looping over the group's query heads and the query tiles that
  can see the key tile, ``s``, ``dp`` and the ``dk``/``dv`` accumulators in
  register micro-tiles. Each ``dk``/``dv`` entry has a single owner thread,
  so there are no atomics and the summation order is fixed.
- ``dq``: a second kernel, ``_backward_dq_kernel``, one block per (batch *
  head, query tile), laid out like the forward, looping over key tiles. This
  costs a second recomputation of the scores but keeps ``dq`` free of atomics
  too (float atomics would make ``dq`` depend on scheduling) and needs no
  extra ``(B, H, N, D)`` buffer per key tile.
- ``dtau``, ``dsigma``: the ``dq`` kernel keeps compensated sums per (row,
  lane), adds them in a fixed order and writes one partial per (batch, head,
  query tile); the host sums these few numbers in float64 in a fixed order.
  The result is deterministic, the partials are tiny next to ``q``, and the
  scalars must come back to the host anyway (they are returned as floats or
  small NumPy arrays). ``dbeta`` is formed on the host from ``delta`` and
  ``lse``.

Score modifiers: every kernel builds the score in the contract's order
(scaled dot product, soft-cap, ALiBi, bias, then NVM on the final score), the
options being runtime values (``softcap`` in ``fopts``, 0 for none; the ALiBi
slope with the window's per-(b, h) constants; the bias as a flat array of the
caller's own entries (its shape), in the kernel dtype, with four element strides,
0 on the axes it is broadcast along, read entry by entry like the mask; a
one-element dummy without a bias). The backward kernels multiply ``ds`` by the
soft-cap's slope ``1 - tanh^2`` before it enters ``dq`` and ``dk``. ``dbias``
is ``ds`` summed over the bias's broadcast axes, deterministically and without
atomics:

- a full ``(B, H, N, M)`` bias: the ``dq`` kernel, whose threads own query
  rows, writes ``ds`` straight into ``dbias`` (each entry has one writer,
  under GQA too, since query heads are distinct); no extra pass.
- a broadcast bias: ``_backward_dbias_kernel``, launched after the delta
  kernel (it reads ``delta``), one block per entry of the bias's compact
  shape (``dbias`` is allocated in that shape, never ``(B, H, N, M)``); its
  threads recompute ``ds`` for the entries the bias entry stands for, in a
  fixed assignment, and the block adds their sums in thread order. This is a
  third recomputation of the scores and of ``dout . v``, without shared-memory
  tiling: about ``B H N M (D + Dv)`` multiply-adds read from global memory
  (cache), the cost of one more backward pass over the kept entries; a bias
  broadcast over every axis (scalar-like) is summed by a single block.

All kernels take the options as runtime arguments and compute in the input
dtype, so there is one compiled specialisation per dtype (float32, float64).
Tile sizes are runtime values too (`elastic_np.cuda._config`, shrunk until
the dynamic shared memory fits for the head dims: ``MAX_SHARED_BYTES`` when
set, else the GPU's opt-in maximum, to which a kernel launched with more than
the default 48 KB is raised first).

Performance: ``python -m elastic_np.cuda --bench`` times the kernels against
``torch.nn.functional.scaled_dot_product_attention`` in float32 on the same
GPU (B=4, H=16, N=4096, D=64 by default); ``--softcap X``, ``--alibi`` and
``--bias {full,keys,padding,rows,scalar}`` time the score modifiers, next to
plain attention in the same run; ``--json FILE`` also times the decoding
shapes and writes everything, with the GPU, driver and library versions, to
``FILE`` (`elastic_np.cli._cuda_bench`); ``elastic-np bench --gpu`` runs the
same benchmark. Measured on an H100 (the performance page,
``docs/performance/h100-cuda.json``), the kernels run at about a tenth of
torch's float32 speed, forward and backward, and the decode kernel at about
0.08 of it. ``--resources`` prints each kernel's registers, local memory,
spills and shared memory from the compiled code, no GPU needed.

Arrays: NumPy inputs are copied to the GPU and the results copied back as
NumPy arrays. Device arrays (anything with ``__cuda_array_interface__``:
numba device arrays, CuPy arrays, PyTorch CUDA tensors) must be C-contiguous;
they are used in place and, when any input is a device array, the results are
numba device arrays, with no host round trip (NumPy inputs next to them are
copied to the device). Device inputs are not scanned for NaN or inf.
``mask`` and ``kv_lengths`` are small option arrays and are taken from the
host. ``bias`` may be a NumPy array (its distinct entries are copied to the
device, converted to the kernel dtype when they differ) or a C-contiguous
device array of the kernel dtype, used in place (one of another dtype makes
a round trip through the host to be converted); with a device bias the
results are device arrays, ``dbias`` too.
"""

import importlib
import warnings

from elastic_np.cuda._compile.report import dynamic_shared_bytes, ptx, resources
from elastic_np.cuda._launch.arrays import check_backward_arrays, dtypes, prepare
from elastic_np.cuda._runtime.gpu import check_available, is_available
from elastic_np.cuda._launch.api import backward, forward

__all__ = [
    "dtypes",
    "is_available",
    "check_available",
    "prepare",
    "check_backward_arrays",
    "forward",
    "backward",
    "ptx",
    "resources",
    "dynamic_shared_bytes",
]

#: Names that moved to the benchmark tool, `elastic_np.cli._cuda_bench`, and still resolve here, deprecated.
_MOVED_TO_THE_BENCHMARK = ("bench", "bench_decode", "bench_record", "BENCH_BIAS_SHAPES", "DECODE_SHAPES")
#: Other names of the flat module this package replaced, deprecated: name -> (module, attribute or None, use).
_DEPRECATED = {
    "BackendUnavailableError": ("elastic_np._contract._errors", "BackendUnavailableError", "elastic_np.BackendUnavailableError"),
    "config": ("elastic_np.cuda._runtime.config", None, "the tunables' module, elastic_np.cuda._runtime.config"),
}


def __getattr__(name):
    """The names that moved, deprecated: the GPU benchmark is a tool now (``elastic-np bench --gpu``)."""
    if name in _MOVED_TO_THE_BENCHMARK:
        # the one import of the tools from this package, for the deprecated names only
        module, attribute = "elastic_np.cli._cuda_bench", name
        use = (f"the GPU benchmark moved to the command-line tool (`elastic-np bench --gpu` or "
               f"`python -m elastic_np.cuda --bench`; the function is elastic_np.cli._cuda_bench.{name})")
    elif name in _DEPRECATED:
        module, attribute, use = _DEPRECATED[name]
        use = f"use {use}"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"elastic_np.cuda.{name} is deprecated: {use}", DeprecationWarning, stacklevel=2)
    found = importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)
