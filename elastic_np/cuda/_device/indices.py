"""The indices of the ``opts`` tuple every kernel takes and of its packed arrays, and the kernels' conventions.

Imports no ``numba.cuda``: the host builds ``opts`` with these indices
(`elastic_np.cuda._launch.options.launch_options`), the kernels read it
with them. Conventions shared by every kernel:

- ``q, k, v`` are C-contiguous ``(B, H, N, D)``, ``(B, Hkv, M, D)``,
  ``(B, Hkv, M, Dv)`` arrays of one real dtype; every floating argument is in
  that dtype, so a float32 kernel computes in float32 throughout.
- Options travel as runtime values, in one tuple ``opts`` of device arrays
  that every kernel takes (built once per call, indexed by the ``O_*``
  constants): ``mask``, ``kv_lengths``, ``band``, ``iopts``, ``fopts``,
  ``tau``, ``beta``, ``bh_consts``, ``bias``. Device functions take ``opts``
  too, or small tuples of the tile geometry (``micro = (row0, c, tpr)``, the
  thread's place in the block's micro-tiles), rather than long argument
  lists. Each array: ``iopts`` (int64, indexed by the ``I_*`` constants),
  ``fopts`` (the dtype, indexed by ``F_*``), ``tau``/``beta`` ``(H,)``,
  ``bh_consts`` ``(B, H, C_COUNT)`` (the per-(b, h) constants: the window's
  and the ALiBi slope; ``(1, 1, C_COUNT)`` when neither is given), ``band``
  int64 ``(B, H, 2)`` (the offsets ``[lo, hi]`` that causal, the window and
  the dynamic window's open band leave: `elastic_np._contract._ranges`),
  ``kv_lengths`` int64 ``(B,)`` and ``mask`` uint8 with each of its four dims
  either full or 1 (broadcast).
- The dq, dk/dv and dbias kernels take the backward's per-row inputs as one
  tuple ``dout_lse_delta``: ``dout`` ``(B, H, N, Dv)``, ``lse`` and ``delta``
  ``(B, H, N)``.
- The additive ``bias`` is a flat array (the dtype) of the caller's distinct
  entries; entry ``(b, h, i, j)`` is ``bias[b sb + h sh + i si + j sj]`` with
  the element strides ``iopts[I_BIAS_SB:I_BIAS_SJ + 1]``, 0 on the axes it is
  broadcast along (`elastic_np._contract._compact.compact_bias` builds both
  for a NumPy bias, as for the CPU kernels). ``dbias`` of a broadcast bias is
  laid out in C order over the bias's own shape padded to four dims,
  ``iopts[I_DBIAS_B:I_DBIAS_J + 1]``. Without a bias it is a one-element
  dummy, never read.
- The score of an entry is built in the contract's order
  (`elastic_np.cuda._device.score`): scaled dot product, soft-cap
  (``fopts[F_SOFTCAP] > 0``), ALiBi, bias; a ``-inf`` bias removes the entry
  like a false mask entry, and NVM tests the final score.
- Shared memory is one dynamic array, carved into tiles by offsets. A tile
  that a thread reads along its own row has a row stride of ``dim + 1`` so
  that the threads of a warp fall in different banks.
"""

# opts: the option arrays every kernel takes, as one tuple (built by `elastic_np.cuda._launch.options.launch_options`)
O_MASK = 0
O_KV_LENGTHS = 1
O_BAND = 2
O_IOPTS = 3
O_FOPTS = 4
O_TAU = 5
O_BETA = 6
O_BH_CONSTS = 7
O_BIAS = 8
O_COUNT = 9

# iopts
I_CAUSAL = 0
I_LEFT = 1
I_RIGHT = 2
I_HAS_MASK = 3
I_NVM = 4
I_HAS_GATE = 5
I_HAS_ALIBI = 6
I_HAS_BIAS = 7
I_BIAS_SB = 8  # element strides of the bias, 0 where broadcast
I_BIAS_SH = 9
I_BIAS_SI = 10
I_BIAS_SJ = 11
I_DBIAS_FULL = 12  # the bias is (B, H, N, M): the dq kernel writes dbias itself
I_ALIGN_KV = 13  # align="kv_lengths": the last query sits at kv_lengths[b], not M (`_diag_shift`)
I_DBIAS_B = 14  # the bias's compact shape (its own, padded to 4 dims): the layout of dbias, C order
I_DBIAS_H = 15
I_DBIAS_I = 16
I_DBIAS_J = 17
I_MMA_TERMS = 18  # tensor-core products per float32 product: 3 (3xTF32) or 1 (TF32; float64)
I_COUNT = 19

# fopts
F_SCALE = 0
F_SHARPNESS = 1
F_THRESHOLD = 2
F_ZERO = 3
F_NEG_INF = 4
F_ONE = 5
F_SOFTCAP = 6  # 0: no soft-cap
F_COUNT = 7

# bh_consts, per (b, h); the window works with u = x / sigma, which neither
# over- nor underflows where the bell is open, unlike sigma^2 and sigma^3
C_NORM = 0  # 1 / (sigma sqrt(2 pi))
C_INV_SIGMA = 1  # 1 / sigma
C_ALIBI = 2  # the ALiBi slope
C_U_SCALE = 3  # u per offset: 2 / ((E_b - 1) sigma), or 0 for E_b <= 1 (E_b: see `_diag_shift`)
C_COUNT = 4

# partials of the dq kernel, per (b, h, query tile)
P_DTAU = 0  # sum dz * s
P_DSIGMA = 1  # sum dz * dlogG/dsigma
P_COUNT = 2
