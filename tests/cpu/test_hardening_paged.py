"""Packed and paged arguments checked against one another (issue 71, items 1, 2, 4, 5 and 9).

Every drawn call either raises a ValueError or TypeError naming the argument
at fault, or gives the float64 reference's answer over the gathered keys;
never a crash or an out-of-bounds read.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elastic_np as enp

FUZZ = settings(max_examples=30, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])


def _table(rng, used, block_size, num_blocks):
    """Each sequence's pages, distinct within a row, drawn from ``num_blocks``; unread entries past the pool."""
    blocks = -(-np.asarray(used) // block_size)
    table = np.full((len(used), max(int(blocks.max(initial=0)), 1)), num_blocks + 5, np.int64)
    for s, n in enumerate(blocks):
        table[s, :n] = rng.permutation(num_blocks)[:n]
    return table


def _gathered(q, k, v, cu_q, table, used, **options):
    """The float64 reference over each sequence's gathered keys, packed: ``(out, lse)``."""
    out = np.empty((q.shape[0], q.shape[1], v.shape[-1]))
    lse = np.empty(q.shape[:2])
    for s, n in enumerate(used):
        pages = table[s, : -(-n // k.shape[1])]
        k_s, v_s = (np.asarray(a[pages], np.float64).reshape(-1, *a.shape[2:])[None, :n] for a in (k, v))
        rows = slice(cu_q[s], cu_q[s + 1])
        o, l_s = enp.attention(np.asarray(q[None, rows], np.float64), k_s, v_s, layout="bnhd", return_lse=True,
                               backend="reference", **options)
        out[rows], lse[rows] = o[0], l_s[0].T
    return out, lse


# ---------------------------------------------------------------------------
# Items 1, 2 and 5: k's and v's pages, their heads and the table
# ---------------------------------------------------------------------------


def test_v_with_fewer_pages_than_the_table_reads_is_an_error_not_a_crash():
    k = np.zeros((10**7, 1, 1, 8), np.float32)  # never touched: calloc's pages stay unmapped
    v = np.zeros((1, 1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="`v` pages"):
        enp.varlen_attention(np.zeros((1, 1, 8), np.float32), k, v, [0, 1], None,
                             block_table=[[10**7 - 1]], seqused_k=[1], backend="cpu")


# Axis of v's (num_blocks, block_size, heads, dim) changed, and by how much (dim: a Dv of its own, allowed).
V_CHANGES = [None, (0, -1), (0, 2), (1, -1), (1, 3), (2, -1), (2, 1), (3, 3)]


@FUZZ
@given(seed=st.integers(0, 2**16), block_size=st.integers(1, 5), Hkv=st.integers(1, 2), group=st.integers(1, 2),
       lengths=st.lists(st.integers(0, 13), min_size=1, max_size=3), queries=st.sampled_from([1, 3, 17]),
       spare=st.integers(0, 3), change=st.sampled_from(V_CHANGES), backend=st.sampled_from(["cpu", "reference"]))
def test_k_and_v_pages_that_disagree_are_an_error_else_the_gathered_answer(seed, block_size, Hkv, group, lengths,
                                                                          queries, spare, change, backend):
    rng = np.random.default_rng(seed)
    used = np.array(lengths) + queries  # a sequence's queries are among its keys
    num_blocks = int((-(-used // block_size)).max()) + spare
    table = _table(rng, used, block_size, num_blocks)
    k_shape = v_shape = [num_blocks, block_size, Hkv, 4]
    if change is not None:
        v_shape = list(k_shape)
        v_shape[change[0]] = max(v_shape[change[0]] + change[1], 0)
    k, v = rng.standard_normal(k_shape), rng.standard_normal(v_shape)
    q = rng.standard_normal((queries * used.size, Hkv * group, 4))
    cu_q = np.arange(used.size + 1) * queries
    call = dict(block_table=table, seqused_k=used, return_lse=True, backend=backend, causal=True, beta=0.5)
    if change is not None and change[0] < 3:
        with pytest.raises(ValueError, match="`v` pages .* must match `k`'s"):
            enp.varlen_attention(q, k, v, cu_q, None, **call)
        return
    out, lse = enp.varlen_attention(q, k, v, cu_q, None, **call)
    want_out, want_lse = _gathered(q, k, v, cu_q, table, used, causal=True, beta=0.5)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_pages_with_no_heads_or_no_keys_are_an_error_naming_k(backend):
    q = np.zeros((1, 1, 8))
    for shape, message in (((4, 4, 0, 8), "`k` and `v` must have one head or more"),
                           ((4, 0, 1, 8), "`k` and `v` pages must hold one key or more")):
        with pytest.raises(ValueError, match=message):
            enp.varlen_attention(q, np.zeros(shape), np.zeros(shape), [0, 1], None, block_table=[[3, 2]],
                                 seqused_k=[0], backend=backend)
    with pytest.raises(ValueError, match="`q`'s 3 heads must be a multiple of its Hkv \\(axis 2\\), 2"):
        enp.varlen_attention(np.zeros((1, 3, 8)), np.zeros((4, 4, 2, 8)), np.zeros((4, 4, 2, 8)), [0, 1], None,
                             block_table=[[3]], seqused_k=[2], backend=backend)


def _per_head_pages(heads, kv_heads, block_size, seed=5):
    """``(q, k, v, per_head_k, per_head_v)``: pages, and the same pages in the per-head order (a copy)."""
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((6, block_size, kv_heads, 8)) for _ in range(2))
    return (rng.standard_normal((2, heads, 8)), k, v, *(np.ascontiguousarray(a.swapaxes(1, 2)) for a in (k, v)))


#: The per-head pages' error: the shape expected, the one given, the order they look like.
PER_HEAD = ("`k` and `v` must be pages of shape \\(num_blocks, block_size, Hkv, D\\), got `k` of shape {shape}: "
            ".*per-head order \\(num_blocks, Hkv, block_size, D\\).*`k.swapaxes\\(1, 2\\)`")


# heads that do not divide H (8 heads, pages read as 16), then heads that do, but pages too small for `seqused_k`
@pytest.mark.parametrize("heads, kv_heads, block_size", [(8, 2, 16), (32, 8, 16)])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_pages_in_the_per_head_order_are_an_error_about_their_shape(heads, kv_heads, block_size, backend):
    q, k, v, k_per_head, v_per_head = _per_head_pages(heads, kv_heads, block_size)
    call = dict(block_table=[[0, 1], [2, 3]], seqused_k=[20, 7], backend=backend)
    shape = str(k_per_head.shape).replace("(", "\\(").replace(")", "\\)")
    with pytest.raises(ValueError, match=PER_HEAD.format(shape=shape)):
        enp.varlen_attention(q, k_per_head, v_per_head, [0, 1, 2], None, **call)
    swapped = enp.varlen_attention(q, k_per_head.swapaxes(1, 2), v_per_head.swapaxes(1, 2), [0, 1, 2], None, **call)
    assert np.array_equal(swapped, enp.varlen_attention(q, k, v, [0, 1, 2], None, **call))


def test_seqused_k_beyond_the_pages_in_either_order_is_still_an_error_about_seqused_k():
    q, _, _, k_per_head, v_per_head = _per_head_pages(32, 8, 16)
    with pytest.raises(ValueError, match="a paged cache needs `seqused_k`.* 2 pages of 8, got \\[40, 7\\]"):
        enp.varlen_attention(q, k_per_head, v_per_head, [0, 1, 2], None, block_table=[[0, 1], [2, 3]],
                             seqused_k=[40, 7], backend="reference")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_packed_k_and_v_must_have_as_many_keys_and_heads(backend):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((5, 2, 4)), rng.standard_normal((7, 2, 4))
    for v_shape in ((8, 2, 4), (6, 2, 4), (7, 1, 4), (7, 4, 4)):
        with pytest.raises(ValueError, match="`v` \\(total_k, heads\\) .* must match `k`'s \\(7, 2\\)"):
            enp.varlen_attention(q, k, rng.standard_normal(v_shape), [0, 2, 5], [0, 3, 7], backend=backend)


# ---------------------------------------------------------------------------
# Item 5: max_q and max_k
# ---------------------------------------------------------------------------

BAD_MAXIMA = st.one_of(st.floats(allow_nan=True), st.text(max_size=3), st.booleans(),
                       st.just(np.array([8, 8])), st.just(np.array(8.0)), st.just([8]), st.integers(-3, -1))


@FUZZ
@given(value=st.one_of(st.integers(0, 40), st.integers(0, 40).map(np.int32), BAD_MAXIMA),
       name=st.sampled_from(["max_q", "max_k"]), paged=st.booleans())
def test_max_q_and_max_k_are_integers_at_least_the_longest(value, name, paged):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((9, 2, 4))
    cu_q = [0, 7, 9]
    if paged:
        k = v = rng.standard_normal((6, 4, 2, 4))
        keys = dict(cu_seqlens_k=None, block_table=[[0, 1, 2], [3, 4, 5]], seqused_k=[7, 11])
    else:
        k = v = rng.standard_normal((16, 2, 4))
        keys = dict(cu_seqlens_k=[0, 5, 16])
    longest = {"max_q": 7, "max_k": 11}[name]
    call = dict(keys, backend="reference", causal=True)
    valid = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if valid and value >= longest:
        np.testing.assert_array_equal(enp.varlen_attention(q, k, v, cu_q, **call, **{name: value}),
                                      enp.varlen_attention(q, k, v, cu_q, **call))
        return
    with pytest.raises((ValueError, TypeError), match=f"`{name}`"):
        enp.varlen_attention(q, k, v, cu_q, **call, **{name: value})


# ---------------------------------------------------------------------------
# Item 4: the backward's row counts
# ---------------------------------------------------------------------------


@FUZZ
@given(name=st.sampled_from(["dout", "out", "lse", "dlse"]), axis=st.integers(0, 2),
       by=st.sampled_from([-3, -1, 1, 2]), backend=st.sampled_from(["cpu", "reference"]))
def test_the_backward_takes_exactly_the_forwards_rows(name, axis, by, backend):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((8, 2, 4)) for _ in range(3))
    cu = [0, 3, 8]
    out, lse = enp.varlen_attention(q, k, v, cu, cu, return_lse=True, backend="reference")
    arrays = {"dout": rng.standard_normal(out.shape), "out": out, "lse": lse, "dlse": rng.standard_normal(lse.shape)}
    good = enp.varlen_attention_backward(arrays["dout"], q, k, v, out, lse, cu, cu, dlse=arrays["dlse"],
                                         backend=backend)
    np.testing.assert_allclose(good.dq, enp.varlen_attention_backward(
        arrays["dout"], q, k, v, out, lse, cu, cu, dlse=arrays["dlse"], backend="reference").dq, atol=1e-12)
    bad = arrays[name]
    axis = min(axis, bad.ndim - 1)
    if by < 0:
        bad = np.delete(bad, np.arange(min(-by, bad.shape[axis])), axis=axis)
    else:
        bad = np.concatenate([bad, np.take(bad, np.arange(by), axis=axis)], axis=axis)
    arrays[name] = bad
    with pytest.raises(ValueError, match=f"`{name}` must have shape"):
        enp.varlen_attention_backward(arrays["dout"], q, k, v, arrays["out"], arrays["lse"], cu, cu,
                                      dlse=arrays["dlse"], backend=backend)


# ---------------------------------------------------------------------------
# Item 9: big-endian inputs
# ---------------------------------------------------------------------------


def _big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


@FUZZ
@given(which=st.sets(st.sampled_from("qkv"), min_size=1), dtype=st.sampled_from([np.float32, np.float64]),
       paged=st.booleans())
def test_big_endian_inputs_are_a_type_error_on_the_cpu_and_read_by_the_reference(which, dtype, paged):
    rng = np.random.default_rng(4)
    if paged:
        arrays = {"q": rng.standard_normal((2, 2, 4)), "k": rng.standard_normal((3, 4, 1, 4)),
                  "v": rng.standard_normal((3, 4, 1, 4))}
        call = dict(cu_seqlens_q=[0, 1, 2], cu_seqlens_k=None, block_table=[[0, 1], [2, 0]], seqused_k=[6, 3])
        entry = enp.varlen_attention
    else:
        arrays = {name: rng.standard_normal((1, 2, 5, 4)) for name in "qkv"}
        call, entry = {}, enp.attention
    arrays = {name: a.astype(dtype) for name, a in arrays.items()}
    swapped = {name: _big_endian(a) if name in which else a for name, a in arrays.items()}
    first = min(which, key="qkv".index)
    with pytest.raises(TypeError, match=f"`{first}` is stored big-endian"):
        entry(**swapped, **call, backend="cpu")
    np.testing.assert_array_equal(entry(**swapped, **call, backend="reference"),
                                  entry(**arrays, **call, backend="reference"))


# ---------------------------------------------------------------------------
# The torch adapter goes through the same checks
# ---------------------------------------------------------------------------


def test_the_torch_adapter_checks_the_pages_and_maxima():
    torch = pytest.importorskip("torch")
    import elastic_np.torch as enpt

    q = torch.zeros(1, 1, 8)
    k = torch.zeros(10**5, 1, 1, 8)
    with pytest.raises(ValueError, match="`v` pages"):
        enpt.varlen_attention(q, k, torch.zeros(1, 1, 1, 8), [0, 1], None, block_table=torch.tensor([[10**5 - 1]]),
                              seqused_k=torch.tensor([1]), backend="cpu")
    with pytest.raises(ValueError, match="`max_k`=0"):
        enpt.varlen_attention(q, k[:2], k[:2], [0, 1], None, block_table=torch.tensor([[1]]),
                              seqused_k=torch.tensor([1]), max_k=0, backend="cpu")


def test_the_torch_adapter_names_pages_in_the_per_head_order():
    torch = pytest.importorskip("torch")
    import elastic_np.torch as enpt

    q, k, v, k_per_head, v_per_head = (torch.from_numpy(a) for a in _per_head_pages(32, 8, 16))
    call = dict(block_table=torch.tensor([[0, 1], [2, 3]]), seqused_k=torch.tensor([20, 7]), backend="cpu")
    with pytest.raises(ValueError, match=PER_HEAD.format(shape="\\(6, 8, 16, 8\\)")):
        enpt.varlen_attention(q, k_per_head, v_per_head, torch.tensor([0, 1, 2]), None, 1, 20, **call)
    swapped = enpt.varlen_attention(q, k_per_head.swapaxes(1, 2), v_per_head.swapaxes(1, 2), [0, 1, 2], None, **call)
    assert torch.equal(swapped, enpt.varlen_attention(q, k, v, [0, 1, 2], None, **call))
