"""Packed batches of sequences of different lengths (``cu_seqlens``), as torch's ``varlen_attn`` takes them.

Sequence ``s`` holds the queries ``q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]]``
and the keys and values ``k[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]``; each is
attended to on its own, causality and the windows aligned to its own end.
The sequences go to `elastic_np.attention` one by one as views in
FlashAttention's layout (``layout="bnhd"``, no copy of the inputs), so the
results are, by construction, the bits of calling it sequence by sequence,
and no padding is ever computed.
"""

import dataclasses
import functools
import operator

import numpy as np

from elastic_np._api import cache_scales, dispatch, paged_plans
from elastic_np._api import paged as paged_cache
from elastic_np._contract import _spec, _validation
from elastic_np._contract._types import AttentionGrads, DynamicWindow
from elastic_np._variants.variant import make_variant

#: The options that describe a padded batch (`_spec.PER_CALL`) that a packed batch takes one per sequence:
#: a list of ``S`` arrays, the ``s``-th broadcastable to sequence ``s``'s ``(H, N_s, M_s)``.
PER_SEQUENCE = ("mask", "bias")

#: The options of `_spec.PER_CALL` a packed batch takes as a padded one does, for every sequence: a quantized
#: cache's scales (one for the tensor or one per kv head).
CACHE_SCALES = ("k_scale", "v_scale")

#: The options a packed batch takes, those its functions' signatures list: the padded batch's others are refused.
OPTIONS = tuple(name for name in _spec.NAMES
                if name not in _spec.PER_CALL or name in PER_SEQUENCE or name in CACHE_SCALES)
#: Why a packed batch does not take the other options that describe a padded batch.
_NOT_TAKEN = ("the packed arrays are (total, heads, dim) and each sequence's used keys are `seqused_k`, "
              "which also aligns its queries to its last used key")


def _offsets(cu, name, total):
    """``cu`` as int64 offsets: 1-D, from 0, nondecreasing, ending at ``total``."""
    cu = np.asarray(cu)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"`{name}` must be a 1-D integer array of offsets of one sequence or more, got "
                         f"{cu.dtype} {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
        raise ValueError(f"`{name}` must rise from 0 to the packed length {total} without falling, "
                         f"got {cu.tolist() if cu.size <= 12 else cu}")
    return cu


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_k):
    """``(cu_q, cu_k, used)``: the checked offsets and the keys each sequence uses (None: all)."""
    cu_q = _offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cu_q.size != cu_k.size:
        raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_k` must name as many sequences, got "
                         f"{cu_q.size - 1} and {cu_k.size - 1}")
    for name, cu, limit in (("max_q", cu_q, max_q), ("max_k", cu_k, max_k)):
        _check_longest(np.diff(cu), name, limit, "the longest sequence")
    used = None
    if seqused_k is not None:
        used = np.asarray(seqused_k)
        if used.shape != (cu_k.size - 1,) or not np.issubdtype(used.dtype, np.integer) \
                or (used < 0).any() or (used > np.diff(cu_k)).any():
            raise ValueError(f"`seqused_k` must give each of the {cu_k.size - 1} sequences a number of keys "
                             f"from 0 to its length, got {used}")
    return cu_q, cu_k, used


def check_maximum(value, name):
    """``max_q`` or ``max_k`` as an int (or None): a `TypeError` or `ValueError` naming it unless an integer >= 0."""
    if value is None:
        return None
    try:
        index = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        index = None
    if index is None:
        raise TypeError(f"`{name}` must be an integer or None, got {type(value).__name__} {value!r}")
    if index < 0:
        raise ValueError(f"`{name}` must be at least 0, got {index}")
    return index


def _check_longest(lengths, name, limit, what):
    """A `ValueError` naming ``name`` unless ``limit`` (None: unchecked) is at least every one of ``lengths``."""
    limit = check_maximum(limit, name)
    if limit is not None and lengths.max(initial=0) > limit:
        raise ValueError(f"`{name}`={limit} is below {what}, {lengths.max()}")


def _check_chunks(lengths_q, used):
    """A `ValueError` unless each paged sequence's queries are among its ``seqused_k`` keys (its newest tokens)."""
    over = np.flatnonzero(lengths_q > used)
    if over.size:
        s = over[0]
        raise ValueError(f"with `block_table`, a sequence's queries are its last tokens, so at most its "
                         f"`seqused_k`: sequence {s} has {lengths_q[s]} queries (`cu_seqlens_q`) and "
                         f"{used[s]} keys (`seqused_k`)")


def _arrays(q, k, v, paged=False):
    arrays = [np.asarray(a) for a in (q, k, v)]
    for name, a in zip("qkv", arrays):
        if name != "q" and paged and a.ndim != 4:
            raise ValueError(f"with `block_table`, `{name}` must be pages (num_blocks, block_size, heads, dim), "
                             f"got {a.shape}")
        if (name == "q" or not paged) and a.ndim != 3:
            raise ValueError(f"`{name}` must have shape (total, heads, dim), got {a.shape}")
    _check_keys_and_values(*arrays, paged)
    return arrays


def _check_keys_and_values(q, k, v, paged):
    """A `ValueError` naming the argument unless ``k`` and ``v`` hold the same keys, with heads that fit ``q``'s.

    Pages: as many, of as many keys, with as many heads; packed keys: as
    many, with as many heads. ``v`` may have a head dim of its own.
    """
    agree, what = (3, "pages (num_blocks, block_size, heads)") if paged else (2, "(total_k, heads)")
    if v.shape[:agree] != k.shape[:agree]:
        raise ValueError(f"`v` {what} {v.shape[:agree]} must match `k`'s {k.shape[:agree]}")
    if paged and k.shape[1] == 0:
        raise ValueError("`k` and `v` pages must hold one key or more, got block_size 0")
    heads = k.shape[-2]
    if heads == 0:
        raise ValueError("`k` and `v` must have one head or more, got 0")
    if q.shape[1] % heads and paged:
        raise paged_cache.page_shape_error(q.shape[1], k, f"`q`'s {q.shape[1]} heads must be a multiple of its Hkv "
                                           f"(axis 2), {heads}")
    if q.shape[1] % heads:
        raise ValueError(f"`q`'s {q.shape[1]} heads must be a multiple of `k`'s {heads}")


def check_options(options):
    """Raise a `ValueError` for an option of `_spec.PER_CALL` that a packed batch does not take as given.

    `PER_SEQUENCE`'s must be None or a list (or tuple) of arrays, one per
    sequence; their count and shapes are checked with the sequences'
    (`_per_sequence_shapes`).
    """
    for name in _spec.PER_CALL:
        value = options[name]
        if name in CACHE_SCALES:
            continue
        if name in PER_SEQUENCE:
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"varlen attention takes `{name}` as a list of one array per sequence, the s-th "
                    f"broadcastable to that sequence's (H, N_s, M_s), got {type(value).__name__} of shape "
                    f"{np.shape(value)}; one over the whole pack, (..., total_q, total_k), gives its diagonal "
                    f"blocks: [{name}[..., cu_seqlens_q[s]:cu_seqlens_q[s + 1], "
                    f"cu_seqlens_k[s]:cu_seqlens_k[s + 1]] for s in range(S)]")
        elif not _spec._is_default(value, _spec._BY_NAME[name]):
            raise ValueError(f"varlen attention does not take `{name}`: {_NOT_TAKEN}")


def _per_sequence_shapes(options, heads, lengths_q, lengths_k):
    """Check each `PER_SEQUENCE` option's arrays against their sequence's ``(H, N_s, M_s)``."""
    count = len(lengths_q)
    for name in PER_SEQUENCE:
        values = options[name]
        if values is None:
            continue
        if len(values) != count:
            raise ValueError(f"`{name}` must hold one array per sequence, {count}, got {len(values)}")
        for s, value in enumerate(values):
            shape, want = np.shape(value), (heads, int(lengths_q[s]), int(lengths_k[s]))
            try:
                np.broadcast_shapes(shape, (1, *want))
                fits = len(shape) <= 4
            except ValueError:
                fits = False
            if not fits:
                raise ValueError(f"`{name}[{s}]` of shape {shape} is not broadcastable to sequence {s}'s "
                                 f"(H, N_s, M_s) = {want}")


def _batched(value, count):
    """Whether an option's array holds one row per sequence: shape ``(count, ...)``."""
    return isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[0] == count


def _per_sequence(value, which, count):
    """An option's value for the sequences ``which`` (a slice or indices): a `_batched` array's rows, else as it is."""
    if isinstance(value, DynamicWindow):
        return dataclasses.replace(value, sigma=_per_sequence(value.sigma, which, count))
    return value[which] if _batched(value, count) else value


def _subset_options(options, which, count):
    """``options`` for the sequences ``which`` of ``count``: the rows of its per-sequence arrays taken."""
    return {**options, **{name: _per_sequence(options[name], which, count) for name in ("alibi_slopes",
                                                                                          "dynamic_window")}}


def _sequence_options(options, used, s, count, cu_k=None):
    """``options`` for sequence ``s`` alone, its keys in a batch entry of their own (``cu_k``: packed keys, whose
    fine scales are taken too)."""
    per = _subset_options(options if cu_k is None else cache_scales.sequence(options, s, cu_k), slice(s, s + 1),
                          count)
    per.update({name: options[name][s] for name in PER_SEQUENCE if options[name] is not None})
    extra = {} if used is None else {"kv_lengths": used[s:s + 1], "align": "kv_lengths"}
    return {**per, **extra, "layout": "bnhd"}


def _decode_groups(q, k, v, cu_q, table, used, options, backend):
    """``{s: (out_s, lse_s)}`` for the sequences of a paged batch that share their decode's few queries' count with
    others: each such group in one call of the CPU decode kernel (`paged_cache.batch`), with the bits of its sequences'
    own calls. A mixed batch's other sequences (prefill chunks) are left to their calls."""
    module = dispatch.get_backend(backend)
    if module.__name__ != "elastic_np.cpu":
        return {}
    lengths, count, group = np.diff(cu_q), cu_q.size - 1, q.shape[1] // k.shape[2]
    done = {}
    for n in np.unique(lengths).tolist():
        seqs = np.flatnonzero(lengths == n)
        if seqs.size < 2 or not module.decode_plan.takes_rows(n, group * n):
            continue
        rows = (cu_q[seqs, None] + np.arange(n)).ravel()
        got = paged_cache.batch(q[rows], k, v, np.arange(seqs.size + 1) * n, table[seqs], used[seqs],
                                _subset_options(options, seqs, count), backend)
        for i, s in enumerate(seqs.tolist() if got is not None else []):
            part = slice(i * n, (i + 1) * n)
            done[s] = got[0][None, part], got[1][part].T[None]
    return done


def _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table, seqused_k, options):
    """The checked ``(q, k, v, cu_q, cu_k, used, options)`` of a packed call."""
    check_options(options)
    q, k, v = _arrays(q, k, v, paged=block_table is not None)
    if block_table is None:
        cu_q, cu_k, used = _sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_k)
        lengths_k = np.diff(cu_k)
    else:
        cu_q, _, _ = _sequences(q, q, cu_seqlens_q, cu_seqlens_q, max_q, None, None)
        cu_k, used = paged_cache.checked_pages(k, block_table, seqused_k, cu_q.size - 1, q.shape[1])
        _check_longest(used, "max_k", max_k, "the most keys a sequence uses (`seqused_k`)")
        _check_chunks(np.diff(cu_q), used)
        lengths_k = used
    options = cache_scales.checked(options, k, v, None if block_table is None else cu_k, used)
    _per_sequence_shapes(options, q.shape[1], np.diff(cu_q), lengths_k)
    window, slopes = options["dynamic_window"], options["alibi_slopes"]
    if isinstance(window, DynamicWindow):
        options = {**options, "dynamic_window": dataclasses.replace(window, sigma=np.asarray(window.sigma))}
    if slopes is not None:
        options = {**options, "alibi_slopes": np.asarray(slopes)}
    return q, k, v, cu_q, cu_k, used, options


@_spec.takes_options(own=(), names=OPTIONS)
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_q=None, max_k=None, block_table=None,
                     seqused_k=None, score_mod=None, mask_mod=None, block_mask=None, captures=(), return_lse=False,
                     backend="auto", **options):
    """`elastic_np.attention` over a packed batch of sequences of different lengths, with no padding.

    The layout of ``torch.nn.attention.varlen.varlen_attn``, the offsets
    named as FlashAttention names them (``cu_seqlens_q``; torch's
    ``cu_seq_q``, which `elastic_np.torch.varlen_attention` takes as well).

    Parameters
    ----------
    q : array_like, shape (total_q, H, D)
    k, v : array_like, shape (total_k, Hkv, D) and (total_k, Hkv, Dv)
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (S + 1,)
        Where each of the ``S`` sequences starts, from 0 to the packed length.
    max_q, max_k : int, optional
        The longest sequences (with ``block_table``, ``max_k`` bounds
        ``seqused_k``), checked when given.
    block_table : array_like of int, shape (S, max_blocks), optional
        A paged cache: ``k`` and ``v`` are then pages of shape
        ``(num_blocks, block_size, Hkv, D)`` and sequence ``s`` uses the
        first ``seqused_k[s]`` keys of the pages ``block_table[s]``: the
        CPU kernels read them in place, the decode kernel for up to 16
        queries a sequence (in one call over the sequences with as many
        queries, where none has a ``mask`` or ``bias``), the prefill kernel
        for a longer chunk (on AMX tiles, a bfloat16 one, its values
        transposed from the pages into that kernel's copy), so that one
        call takes a server's mixed step; the other backends gather a copy
        of each sequence's keys first. ``k`` and ``v`` have as many
        pages, of as many keys and heads. Read in place where C-contiguous,
        read-only or not, or stored per head (``(num_blocks, Hkv,
        block_size, D)`` given as its ``transpose(0, 2, 1, 3)``); of any
        other layout, the pages the call reads (only those) are copied first. ``cu_seqlens_k`` is then ignored (it
        may be None). The forward only.
    seqused_k : array_like of int, shape (S,), optional
        Keys each sequence uses (a cache's filled part; required with
        ``block_table``); its queries are the last ones before them
        (causality and windows align there), so with ``block_table`` a
        sequence has at most ``seqused_k[s]`` queries.
    %(options)s
        ``alibi_slopes`` of shape ``(S, H)`` and a window's ``sigma`` of shape
        ``(S, H)`` or ``(S, 1)`` go per sequence. ``mask`` and ``bias`` go
        per sequence, as a list of ``S`` arrays, the ``s``-th broadcastable to
        sequence ``s``'s ``(H, N_s, M_s)`` (``M_s`` its keys; with
        ``block_table``, its used keys). ``kv_lengths``, ``align`` and
        ``layout``, which describe a padded batch, are not taken (see
        ``seqused_k``).
    score_mod, mask_mod, block_mask, captures : optional
        A user's variant (`elastic_np.attention`'s), applied sequence by
        sequence: its ``b`` is the sequence, its indices count from each
        sequence's first query and key (with ``block_table``, its first used
        key: on the CPU read from the pages in place). A block mask is made
        for ``(S, H, max_q, max_k)`` (or with ``None`` for ``S`` or ``H``:
        the same for each), ``b`` the sequence: each sequence takes its
        first blocks.
    return_lse : bool, optional
        Also return ``lse`` of shape ``(total_q, H)``.
    backend : {"auto", "reference", "cpu", "cuda"}, optional

    Returns
    -------
    out : ndarray, shape (total_q, H, Dv)
    lse : ndarray, shape (total_q, H)
        Only with ``return_lse=True``.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((7, 2, 4)) for _ in range(3))  # sequences of 3 and 4
    >>> out = enp.varlen_attention(q, k, v, [0, 3, 7], [0, 3, 7], causal=True, backend="reference")
    >>> second = enp.attention(q[None, 3:], k[None, 3:], v[None, 3:], causal=True, layout="bnhd",
    ...                        backend="reference")
    >>> bool(np.array_equal(out[3:], second[0]))
    True
    """
    options = _spec.complete(options, "varlen_attention")
    variant = make_variant(score_mod, mask_mod, block_mask, captures)
    call_key = None if block_table is None or variant is not None else paged_plans.key(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table, seqused_k, return_lse, backend, options)
    if call_key is not None:
        run = paged_plans.PLANS.get(call_key)
        if run is not None:
            return paged_plans.run(run, q, k, v, return_lse)
    q, k, v, cu_q, cu_k, used, options = _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table,
                                                 seqused_k, options)
    grouped = block_table is not None and variant is None and all(options[name] is None for name in PER_SEQUENCE)
    batched = paged_cache.batch(q, k, v, cu_q, cu_k, used, options, backend) if grouped else None
    if batched is not None:
        paged_plans.keep(call_key, batched[2])
        return batched[:2] if return_lse else batched[0]
    done = _decode_groups(q, k, v, cu_q, cu_k, used, options, backend) if grouped else {}
    _check_block_mask(variant, q, cu_q, np.diff(cu_k) if block_table is None else used)
    out, lse = _sequence_calls((q, k, v), cu_q, cu_k, used, block_table is not None, options, variant, done,
                               backend)
    return (out, lse) if return_lse else out


def _sequence_calls(qkv, cu_q, cu_k, used, paged, options, variant, done, backend):
    """The packed ``(out, lse)`` of `varlen_attention`'s sequences not in ``done``, one call each: a user's
    variant's, `attention`'s, or a paged cache's (``paged``: ``cu_k`` holds the block table)."""
    q, k, v = qkv
    count = cu_q.size - 1
    if paged:  # exactly the used keys: the queries sit before the last of them
        return _sequence_by_sequence(q, cu_q, done, lambda s, rows, into: paged_cache.sequence(
            q[None, rows], k, v, cu_k[s:s + 1], used[s], _sequence_options(options, None, s, count), backend,
            into=into, variant=_sequence_variant(variant, s, cu_q[s + 1] - cu_q[s], used[s])),
            _cpu_output(q, v, backend))
    if variant is not None:
        return _sequence_by_sequence(q, cu_q, done, lambda s, rows, into: dispatch.variant_forward(
            q[None, rows], k[None, cu_k[s]:cu_k[s + 1]], v[None, cu_k[s]:cu_k[s + 1]],
            _spec.complete(_sequence_options(options, used, s, count, cu_k), "varlen_attention"),
            _sequence_variant(variant, s, cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]), True, backend), None)
    return _sequence_by_sequence(q, cu_q, done, lambda s, rows, into: dispatch.attention(
        q[None, rows], k[None, cu_k[s]:cu_k[s + 1]], v[None, cu_k[s]:cu_k[s + 1]], return_lse=True,
        backend=backend, **_sequence_options(options, used, s, count, cu_k)), None)


def _sequence_variant(variant, s, n_q, n_k):
    """Sequence ``s``'s variant (None without one): ``b = s``, and the block mask's blocks of its ``n_q`` queries
    over its ``n_k`` keys."""
    if variant is None:
        return None
    block_mask = variant.block_mask
    if block_mask is not None:
        block_mask = block_mask.sequence(s, int(n_q), int(n_k))
    return dataclasses.replace(variant, batch_offset=s, block_mask=block_mask)


def _check_block_mask(variant, q, cu_q, key_counts):
    """A `ValueError` naming ``block_mask`` unless the variant's (if any) covers the packed batch's sequences, of
    ``key_counts`` keys each."""
    if variant is not None and variant.block_mask is not None:
        variant.block_mask.for_sequences(cu_q.size - 1, q.shape[1], int(np.diff(cu_q).max(initial=0)),
                                         int(np.max(key_counts, initial=0)))


def _cpu_output(q, v, backend):
    """``(out, lse)`` of a paged call on the CPU, allocated ahead for its kernels to write into, else None."""
    if dispatch.get_backend(backend).__name__ != "elastic_np.cpu":
        return None
    return (np.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype),  # q's dtype, a quantized cache's too
            np.empty(q.shape[:2], dtype=_validation.compute_dtype(q.dtype)))


def _sequence_by_sequence(q, cu_q, done, attend, output):
    """The packed ``(out, lse)`` of ``attend(s, rows, into) -> (out_s, lse_s)`` for each sequence ``s`` not in
    ``done`` (those its results); ``output``: the packed arrays, or None (made as the first result's)."""
    out, lse = (None, None) if output is None else output
    for s in range(cu_q.size - 1):
        rows = slice(cu_q[s], cu_q[s + 1])
        out_s, lse_s = done[s] if s in done else attend(s, rows, None if out is None else out[None, rows])
        if out is None:
            out = np.empty((q.shape[0], *out_s.shape[2:]), dtype=out_s.dtype)
            lse = np.empty(q.shape[:2], dtype=lse_s.dtype)
        if not np.may_share_memory(out, out_s):  # else written in place (``into``)
            out[rows] = out_s[0]
        lse[rows] = lse_s[0].T
    return out, lse


@_spec.takes_options(own=(), names=OPTIONS)
def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, dlse=None, max_q=None,
                              max_k=None, seqused_k=None, score_mod=None, mask_mod=None, block_mask=None,
                              captures=(), backend="auto", **options):
    """Gradients of `varlen_attention`, sequence by sequence (`elastic_np.attention_backward`'s bits).

    Parameters
    ----------
    dout : array_like, shape (total_q, H, Dv)
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_k
        As given to `varlen_attention`.
    out, lse : array_like
        What `varlen_attention` returned with ``return_lse=True``.
    dlse : array_like, shape (total_q, H), optional
        Cotangent of ``lse``.
    %(options)s
        As given to `varlen_attention`.
    score_mod, mask_mod, block_mask, captures : optional
        As given to `varlen_attention`.
    backend : {"auto", "reference", "cpu", "cuda"}, optional

    Returns
    -------
    AttentionGrads
        ``dq``, ``dk``, ``dv`` packed like ``q``, ``k``, ``v``; ``dtau``,
        ``dbeta``, a shared ``sigma``'s ``dsigma`` and the captures'
        ``dcaptures`` summed over the sequences in order; a per-sequence ``sigma``'s ``dsigma`` per sequence;
        ``dbias`` a list, each sequence's in the shape of its ``bias``.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((7, 2, 4)) for _ in range(3))
    >>> out, lse = enp.varlen_attention(q, k, v, [0, 3, 7], [0, 3, 7], beta=0.5, return_lse=True,
    ...                                 backend="reference")
    >>> grads = enp.varlen_attention_backward(np.ones_like(out), q, k, v, out, lse, [0, 3, 7], [0, 3, 7],
    ...                                       beta=0.5, backend="reference")
    >>> grads.dq.shape, type(grads.dbeta).__name__
    ((7, 2, 4), 'float')
    """
    options = _spec.complete(options, "varlen_attention_backward")
    q, k, v, cu_q, cu_k, used, options = _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, None,
                                                 seqused_k, options)
    dout, out, lse = (np.asarray(a) for a in (dout, out, lse))
    dlse = None if dlse is None else np.asarray(dlse)
    _check_rows(q, v, dout=dout, out=out, lse=lse, dlse=dlse)
    count = cu_q.size - 1
    variant = make_variant(score_mod, mask_mod, block_mask, captures)
    _check_block_mask(variant, q, cu_q, np.diff(cu_k))
    parts = []
    for s in range(count):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        arrays = (dout[None, rows], q[None, rows], k[None, keys], v[None, keys], out[None, rows], lse[rows].T[None],
                  None if dlse is None else dlse[rows].T[None])
        sequence = _sequence_options(options, used, s, count, cu_k)
        if variant is None:
            parts.append(dispatch.attention_backward(*arrays[:6], dlse=arrays[6], backend=backend, **sequence))
        else:
            parts.append(dispatch.variant_backward(arrays, _spec.complete(sequence, "varlen_attention_backward"),
                                                   _sequence_variant(variant, s, cu_q[s + 1] - cu_q[s],
                                                                     cu_k[s + 1] - cu_k[s]), backend))
    return _packed_grads(parts, q, k, v, cu_q, cu_k, options)


def _check_rows(q, v, **arrays):
    """A `ValueError` naming the array unless it has one row per packed query.

    ``dout`` and ``out``: ``(total_q, H, Dv)``; ``lse`` and ``dlse`` (None:
    not given): ``(total_q, H)``.
    """
    for name, a in arrays.items():
        if a is None:
            continue
        rows, axes = q.shape[:2], "(total_q, H)"
        if name in ("dout", "out"):
            rows, axes = (*rows, v.shape[-1]), "(total_q, H, Dv)"
        if a.shape != rows:
            raise ValueError(f"`{name}` must have shape {axes} = {rows}, one row per packed query, got {a.shape}")


def _packed_grads(parts, q, k, v, cu_q, cu_k, options):
    """The per-sequence `AttentionGrads` as one: arrays packed, the shared options' gradients summed in order."""
    dtype = parts[0].dq.dtype
    dq, dk, dv = (np.empty(a.shape, dtype=dtype) for a in (q, k, v))
    for s, g in enumerate(parts):
        dq[cu_q[s]:cu_q[s + 1]] = g.dq[0]
        dk[cu_k[s]:cu_k[s + 1]], dv[cu_k[s]:cu_k[s + 1]] = g.dk[0], g.dv[0]
    window = options["dynamic_window"]
    per_sequence = window is not None and _batched(window.sigma, len(parts))
    totals = {}
    for name in ("dtau", "dbeta", "dsigma"):
        values = [getattr(g, name) for g in parts]
        if values[0] is None:
            totals[name] = None
        elif name == "dsigma" and per_sequence:
            totals[name] = np.concatenate(values)
        else:  # in sequence order
            totals[name] = functools.reduce(operator.add, values)
    dbias = None if options["bias"] is None else [g.dbias for g in parts]
    dcaptures = None
    if parts[0].dcaptures is not None:  # in sequence order
        dcaptures = tuple(None if d[0] is None else functools.reduce(operator.add, d)
                          for d in zip(*(g.dcaptures for g in parts)))
    return AttentionGrads(dq=dq, dk=dk, dv=dv, dbias=dbias, dcaptures=dcaptures, **totals)
