"""The range arithmetic every kernel shares (`elastic_np._contract._ranges`), against brute force and the reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import elastic_np as enp
from elastic_np import reference
from elastic_np._contract import _problem, _ranges
from elastic_np.cpu._prefill import plan as _plan
from elastic_np.cuda._launch import options as _cuda_options


@settings(max_examples=300, deadline=None)
@given(
    N=st.integers(1, 12), M=st.integers(0, 14), diag_shift=st.integers(-14, 14),
    off_lo=st.integers(-16, 16), width=st.integers(-3, 20), i0=st.integers(0, 11), bq=st.integers(1, 6),
    cut=st.integers(0, 14),
)
def test_key_and_query_ranges_are_the_kept_keys_and_queries(N, M, diag_shift, off_lo, width, i0, bq, cut):
    off_hi = off_lo + width  # lo > hi: nothing kept
    kv_length = min(cut, M)
    i0 = min(i0, N - 1)
    i1 = min(i0 + bq, N)
    i = np.arange(N)[:, None]
    j = np.arange(M)[None, :]
    off = j - i - diag_shift
    kept = (off >= off_lo) & (off <= off_hi) & (j < kv_length)

    keys = np.flatnonzero(kept[i0:i1].any(axis=0))
    j_lo, j_hi = _ranges.key_range(diag_shift, i0, i1, off_lo, off_hi, kv_length)
    assert j_lo <= j_hi
    if keys.size:
        assert (j_lo, j_hi) == (keys[0], keys[-1] + 1)
    else:
        assert j_lo == j_hi

    j0 = min(i0, max(M - 1, 0))
    j1 = min(j0 + bq, kv_length)
    if j1 <= j0:
        return
    queries = np.flatnonzero(kept[:, j0:j1].any(axis=1))
    q_lo, q_hi = _ranges.query_range(diag_shift, j0, j1, off_lo, off_hi, N)
    assert q_lo <= q_hi
    if queries.size:
        assert (q_lo, q_hi) == (queries[0], queries[-1] + 1)
    else:
        assert q_lo == q_hi


def _prepared(**options):
    rng = np.random.default_rng(3)
    B, H, N, M = 2, 3, 9, 13
    q = rng.standard_normal((B, H, N, 4))
    k = rng.standard_normal((B, H, M, 4))
    return _problem.prepare(q, k, k, **options)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(causal=True),
        dict(window_size=(3, 1)),
        dict(window_size=(-1, 2), causal=True),
        dict(window_size=(4, -1), kv_lengths=[5, 13], align="kv_lengths"),
        dict(dynamic_window=enp.DynamicWindow([[0.2, 0.05, 1.0], [0.1, 0.3, 0.02]], threshold=0.4)),
        dict(dynamic_window=enp.DynamicWindow(0.15, threshold=0.5), causal=True, window_size=(2, -1)),
        dict(dynamic_window=enp.DynamicWindow(0.3, threshold=5.0)),  # the gate closed everywhere
    ],
)
def test_the_offset_bands_hold_every_kept_entry(options):
    """Every offset the reference keeps lies in the CPU's band and in the CUDA kernels' (whose gate band is wider)."""
    p = _prepared(**options)
    bands = [
        _plan.kernel_options(p, with_sigma_grad=False, dtype=np.dtype(np.float64)).band,
        _ranges.offset_band(p, _cuda_options.gate_band(p)),
    ]
    keep = reference.structural_keep(p)
    if p.sigma is not None:
        keep = keep & (reference.window_gate(p)[0] > 0)
    B, H, Hkv, N, M, D, Dv = p.shape
    off = np.broadcast_to(reference._attention._offsets(p), (B, H, N, M))
    # the entries with a key past kv_lengths are not the band's (key_range cuts them)
    in_sequence = np.broadcast_to(np.arange(M) < p.kv_lengths[:, None, None, None], keep.shape)
    for b in range(B):
        for h in range(H):
            for lo, hi in (band[b, h] for band in bands):
                kept = off[b, h][keep[b, h]]
                assert ((kept >= lo) & (kept <= hi)).all()
            lo, hi = bands[0][b, h]
            if p.sigma is None:
                continue  # causal and the window bound the offsets, not the entries of a short sequence
            open_offsets = off[b, h][(reference.window_gate(p)[0][b, h] > 0) & in_sequence[b, h]]
            if open_offsets.size == 0 or lo > hi:
                continue
            assert lo >= open_offsets.min() and hi <= open_offsets.max()  # the CPU's gate band is exact
