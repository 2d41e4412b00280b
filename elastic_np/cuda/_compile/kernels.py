"""Every kernel of the CUDA backend, by name, and the conventions they share.

Importing this module imports ``numba.cuda`` and the kernel modules
(`elastic_np.cuda._forward`, `elastic_np.cuda._backward`,
`elastic_np.cuda._decode`); `elastic_np.cuda` does so only when the PTX or
the resource report is asked for (`elastic_np.cuda._compile`). The host
functions that launch them sit beside each kernel module
(`elastic_np.cuda._forward_launch`, `elastic_np.cuda._backward_launch`,
`elastic_np.cuda._decode_launch`), what those share and the backend's
entry points in `elastic_np.cuda._api`, the reasoning behind the design in
`elastic_np.cuda`.

Conventions shared by every kernel:

- ``q, k, v`` are C-contiguous ``(B, H, N, D)``, ``(B, Hkv, M, D)``,
  ``(B, Hkv, M, Dv)`` arrays of one real dtype; every floating argument is in
  that dtype, so a float32 kernel computes in float32 throughout.
- Options travel as runtime values, in one tuple ``opts`` of device arrays
  that every kernel takes (built once per call by
  `elastic_np.cuda._api._launch_options`, indexed by the ``O_*``
  constants of `elastic_np.cuda._device`): ``mask``, ``kv_lengths``,
  ``band``, ``iopts``, ``fopts``, ``tau``, ``beta``, ``bh_consts``,
  ``bias``. Device functions take ``opts`` too, or small tuples of the
  tile geometry (``micro = (row0, c, tpr)``, the thread's place in the
  block's micro-tiles), rather than long argument lists. Each array:
  ``iopts`` (int64, indexed by the ``I_*``
  constants), ``fopts`` (the dtype, indexed by ``F_*``), ``tau``/``beta``
  ``(H,)``, ``bh_consts`` ``(B, H, C_COUNT)`` (the per-(b, h) constants: the
  window's and the ALiBi slope; ``(1, 1, C_COUNT)`` when neither is given),
  ``band`` int64 ``(B, H, 2)`` (the offsets ``[lo, hi]`` that causal, the
  window and the dynamic window's open band leave: `elastic_np._contract._ranges`),
  ``kv_lengths`` int64 ``(B,)`` and ``mask`` uint8 with each of its
  four dims either full or 1 (broadcast).
- The dq, dk/dv and dbias kernels take the backward's per-row inputs as one tuple
  ``dout_lse_delta``: ``dout`` ``(B, H, N, Dv)``, ``lse`` and ``delta``
  ``(B, H, N)``.
- The additive ``bias`` is a flat array (the dtype) of the caller's distinct
  entries; entry ``(b, h, i, j)`` is ``bias[b sb + h sh + i si + j sj]`` with
  the element strides ``iopts[I_BIAS_SB:I_BIAS_SJ + 1]``, 0 on the axes it is
  broadcast along (`elastic_np._contract._compact.compact_bias` builds both for a NumPy
  bias, as for the CPU kernels). ``dbias`` of a broadcast bias is laid out in
  C order over the bias's own shape padded to four dims,
  ``iopts[I_DBIAS_B:I_DBIAS_J + 1]``. Without a bias it is a one-element dummy,
  never read.
- The score of an entry is built in the contract's order
  (`elastic_np.cuda._device._score`): scaled dot product, soft-cap
  (``fopts[F_SOFTCAP] > 0``), ALiBi, bias; a ``-inf`` bias removes the entry
  like a false mask entry, and NVM tests the final score.
- Shared memory is one dynamic array, carved into tiles by offsets. A tile that
  a thread reads along its own row has a row stride of ``dim + 1`` so that the
  threads of a warp fall in different banks.
"""

from elastic_np.cuda._simt import backward as _backward
from elastic_np.cuda._simt import decode as _decode
from elastic_np.cuda._simt import forward as _forward
from elastic_np.cuda._tensor_core import backward as _backward_tc
from elastic_np.cuda._tensor_core import forward as _forward_tc

#: Every kernel of the backend, by name (the PTX and resource reports go through these).
KERNELS = {
    "_forward_kernel": _forward._forward_kernel,
    **{kernel.py_func.__name__: kernel for kernel in _forward_tc.KERNELS.values()},
    **_backward.KERNELS,
    **{kernel.py_func.__name__: kernel for kernel in _backward_tc.KERNELS.values()},
    **_decode.KERNELS,
}
