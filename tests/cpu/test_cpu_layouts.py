"""The CPU kernels read and write ``(B, N, H, D)`` arrays in place: the ``transpose(0, 2, 1, 3)`` views of them.

Every result has the bits of the same call on C-contiguous copies, in every
mix of layouts; outputs come back in the layout of their input (``out`` and
``dq`` like ``q``, ``dk`` like ``k``, ``dv`` like ``v``); the keys and values
are not copied; one compiled kernel per dtype serves both layouts.
"""

import tracemalloc

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from oracle_checks import ALIBI_H, CASES, DTYPES, SIGMA_BH, holds_half_bits, holds_user_variant, make_inputs, random_bias

#: Which of ``q, k, v, dout, out`` a call takes as views of ``(B, N, H, D)`` arrays (the others C-contiguous).
MIXES = {
    "all": {"q", "k", "v", "dout", "out"},
    "queries": {"q", "dout"},
    "keys": {"k", "v"},
    "mixed": {"k", "dout"},
    "out": {"v", "out"},
}

GRADS = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")


def bnhd(a):
    """``a``'s values as the ``(B, H, N, D)`` view of a C-contiguous ``(B, N, H, D)`` array."""
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def stored_bnhd(a):
    """Whether ``a`` is the view of a C-contiguous ``(B, N, H, D)`` array and not C-contiguous itself."""
    return a.transpose(0, 2, 1, 3).flags.c_contiguous and not a.flags.c_contiguous


def _call(q, k, v, dout, opts, out_layout=None):
    """Forward and backward; the backward's ``out`` as `bnhd` gives it (``out_layout="bnhd"``) or C-contiguous."""
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    out_in = bnhd(out) if out_layout == "bnhd" else np.ascontiguousarray(out)
    grads = enp.attention_backward(dout, q, k, v, out_in, lse, backend="cpu", **opts)
    return out, lse, grads


def check_layouts(q, k, v, dout, opts, mixes=MIXES):
    """Every mix of layouts gives the bits of C-contiguous inputs, its outputs in their inputs' layouts."""
    want_out, want_lse, want = _call(q, k, v, dout, opts)
    assert want_out.flags.c_contiguous and want.dq.flags.c_contiguous and want.dk.flags.c_contiguous
    for name, views in mixes.items():
        arrays = {key: bnhd(a) if key in views else a for key, a in zip("q k v dout".split(), (q, k, v, dout))}
        out, lse, grads = _call(*arrays.values(), opts, out_layout="bnhd" if "out" in views else None)
        np.testing.assert_array_equal(out, want_out, err_msg=name)
        np.testing.assert_array_equal(lse, want_lse, err_msg=name)
        for field in GRADS:
            got, expected = getattr(grads, field), getattr(want, field)
            if expected is None:
                assert got is None, (name, field)
            else:
                np.testing.assert_array_equal(got, expected, err_msg=f"{name}: {field}")
        for result, source in ((out, "q"), (grads.dq, "q"), (grads.dk, "k"), (grads.dv, "v")):
            if result.shape[1] > 1 and result.shape[2] > 1:  # else both layouts are C-contiguous
                assert stored_bnhd(result) == (source in views), (name, source)
        assert lse.flags.c_contiguous


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_same_bits_in_every_layout(small_tiles, dtype, case):
    """Every option set of the kernel tests, (2, 4/2, 23, 31) with grouped-query heads, several tiles each way."""
    check_layouts(*make_inputs(dtype), CASES[case])


def _decode_options(B, N, M):
    rng = np.random.default_rng(N + M)
    return {
        "plain": {},
        "causal-lengths": dict(causal=True, kv_lengths=[M - 37, M]),
        "window-nvm-tau-beta": dict(window_size=(300, 0), nvm=True, tau=[0.5, 1.0, 2.0, 0.8], beta=0.4),
        "modifiers": dict(softcap=1.5, alibi_slopes=ALIBI_H, bias=random_bias((B, 1, N, M), 3, pad=0.1)),
        "mask-gate": dict(
            mask=rng.random((N, M)) > 0.3, dynamic_window=enp.DynamicWindow(SIGMA_BH, sharpness=3.0),
        ),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 3, 16])
def test_decode_same_bits_in_every_layout(dtype, N):
    """The decode kernels (rows stacked below 16 queries, heads key-major from 16), split over the keys."""
    B, M = 2, 1100
    inputs = make_inputs(dtype, B=B, N=N, M=M, D=16, Dv=12, seed=N)
    assert cpu._decode.plan.takes(cpu.prepare(*inputs[:3], dtypes=cpu.dtypes))
    assert cpu._decode.plan.splits(B, 2, M) > 1
    for name, opts in _decode_options(B, N, M).items():
        check_layouts(*inputs, opts, MIXES if name == "plain" else {"all": MIXES["all"]})


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_queries_than_keys_same_bits(small_tiles, dtype):
    for opts in ({}, dict(causal=True, kv_lengths=[9, 23]), dict(window_size=(3, 1), beta=0.5)):
        check_layouts(*make_inputs(dtype, N=31, M=23, H=6, Hkv=3, D=5, Dv=7), opts)


def test_one_compiled_kernel_per_dtype_for_both_layouts():
    for dtype in DTYPES:
        for N, M in ((19, 23), (1, 40), (16, 40)):
            q, k, v, dout = make_inputs(dtype, N=N, M=M)
            for arrays in ((q, k, v, dout), tuple(map(bnhd, (q, k, v, dout))), (q, bnhd(k), v, bnhd(dout))):
                out, lse = enp.attention(*arrays[:3], return_lse=True, backend="cpu", causal=True)
                enp.attention_backward(arrays[3], *arrays[:3], out, lse, backend="cpu", causal=True)
            if N > 16:
                continue
            # the same keys from pages of 8, in a shuffled order (the decode kernels read them in place)
            (B, H, _, D), Hkv = q.shape, k.shape[1]
            table = np.random.default_rng(0).permutation(B * M // 8).reshape(B, M // 8)
            k_pages, v_pages = (x.transpose(0, 2, 1, 3).reshape(B * M // 8, 8, Hkv, -1)[table.argsort(axis=None)]
                                for x in (k, v))
            paged = enp.varlen_attention(q.transpose(0, 2, 1, 3).reshape(B * N, H, D), k_pages, v_pages,
                                         np.arange(B + 1) * N, None, block_table=table, seqused_k=np.full(B, M),
                                         backend="cpu")
            out = enp.attention(q, k, v, backend="cpu")
            np.testing.assert_array_equal(paged, out.transpose(0, 2, 1, 3).reshape(paged.shape))
    kernels = (
        cpu._prefill.forward._forward_kernel, cpu._prefill.backward._backward_prepare, cpu._prefill.backward._backward_kernel,
        cpu._prefill.key_tiles.sum_dq_shares, cpu._decode.decode._decode_kernel, cpu._decode.decode._decode_heads_kernel,
        cpu._decode.merge._merge_kernel,
    )
    for kernel in kernels:
        # of the float dtypes (a half's bits are other specialisations; a user's functions compile kernels of
        # their own: tests/variants); the key-major decode kernel's one serves a paged cache too (`pages` is a
        # table, empty for a contiguous cache), the stacked-rows one has one more per dtype for a table
        ours = [sig for sig in kernel.signatures if not holds_half_bits(sig) and not holds_user_variant(sig)]
        allowed = len(DTYPES) * (2 if kernel is cpu._decode.decode._decode_kernel else 1)
        assert len(ours) <= allowed, (kernel.py_func.__name__, ours)


def _peak_bytes(fn):
    """The peak of NumPy's allocations (traced by `tracemalloc`) while ``fn()`` runs."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_keys_and_values_are_not_copied():
    rng = np.random.default_rng(0)
    B, H, Hkv, M, D = 1, 8, 4, 8192, 64
    k, v = (rng.standard_normal((B, M, Hkv, D)).astype(np.float32).transpose(0, 2, 1, 3) for _ in range(2))
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    q64 = rng.standard_normal((B, H, 64, D)).astype(np.float32)
    for queries in (q, q64):  # compiled before measuring
        enp.attention(queries, k[:, :, :100], v[:, :, :100], backend="cpu", causal=True)
    # decoding: nothing of the size of the cache
    assert _peak_bytes(lambda: enp.attention(q, k, v, backend="cpu", causal=True)) < k.nbytes / 16
    # the measure sees a copy: a strided view of another kind is copied as before
    k_strided = np.asfortranarray(k)
    assert _peak_bytes(lambda: enp.attention(q, k_strided, v, backend="cpu", causal=True)) >= k.nbytes
    # prefill: the check of the cache's values (boolean temporaries) is the largest allocation
    assert _peak_bytes(lambda: enp.attention(q64, k, v, backend="cpu", causal=True)) < k.nbytes / 2


def test_outputs_in_their_inputs_layout():
    q, k, v, dout = make_inputs(np.float32, N=20, M=26)
    out, lse = enp.attention(bnhd(q), k, bnhd(v), return_lse=True, backend="cpu")
    assert stored_bnhd(out) and out.base is not None and out.base.shape == (2, 20, 4, 6)
    grads = enp.attention_backward(dout, bnhd(q), k, bnhd(v), out, lse, backend="cpu")
    assert stored_bnhd(grads.dq) and grads.dk.flags.c_contiguous and stored_bnhd(grads.dv)
    # read-only views are read in place too (through a writeable view of their memory), outputs in their layout
    storage = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    storage.setflags(write=False)
    out_frozen = enp.attention(storage.transpose(0, 2, 1, 3), k, v, backend="cpu")
    assert stored_bnhd(out_frozen) and not storage.flags.writeable
    assert np.array_equal(out_frozen, enp.attention(bnhd(q), k, v, backend="cpu"))
