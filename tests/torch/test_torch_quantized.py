"""elastic_np.torch with a quantized key/value cache: int8 and float8 ``k``, ``v`` and `elastic_np.torch.quantize_kv`."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import elastic_np as enp  # noqa: E402
import elastic_np.torch as enpt  # noqa: E402
from elastic_np._api import adapters as common  # noqa: E402
from elastic_np._contract import _spec  # noqa: E402
from elastic_np.torch import _arrays, _ops  # noqa: E402

#: The storage dtypes, torch's and NumPy's.
DTYPES = {torch.int8: np.dtype(np.int8), torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
          torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2)}
#: The scale granularities, with their group size.
SCALES = [("head", None), ("tensor", None), ("token", None), ("group", 16)]
B, H, Hkv, M = 2, 4, 2, 37


def _numpy(data):
    """A quantized tensor's NumPy array, read from its bits (without the adapter's `_arrays.to_numpy`)."""
    if data.dtype == torch.int8:
        return data.numpy()
    return data.view(torch.uint8).numpy().view(DTYPES[data.dtype])


def _bits(x):
    """A tensor's bytes, for a bit-for-bit comparison."""
    return x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _cache(N, D, dtype, scale, group_size, seed=0):
    """``q`` as a float32 tensor and the cache quantized by `enpt.quantize_kv`: ``q, k, v, k_scale, v_scale``."""
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(rng.standard_normal((B, H, N, D)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((B, Hkv, M, D)).astype(np.float32)) for _ in range(2))
    (k, k_scale), (v, v_scale) = (enpt.quantize_kv(x, dtype, scale=scale, group_size=group_size) for x in (k, v))
    return q, k, v, k_scale, v_scale


@pytest.mark.parametrize("N", [1, 20], ids=["decode", "prefill"])
@pytest.mark.parametrize("scale, group_size", SCALES, ids=[s for s, _ in SCALES])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_attention_on_a_quantized_cache_is_the_numpy_call(dtype, scale, group_size, N):
    D = 32 if N == 1 else 64
    tensors = _cache(N, D, dtype, scale, group_size, seed=N)
    before = [_bits(x) for x in tensors]
    q, k, v, k_scale, v_scale = tensors
    out, lse = enpt.attention(q, k, v, k_scale=k_scale, v_scale=v_scale, causal=N > 1, return_lse=True)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == (B, H, N, D)
    arrays = (q.numpy(), _numpy(k), _numpy(v))
    scales = {"k_scale": k_scale.numpy(), "v_scale": v_scale.numpy()}
    want, want_lse = enp.attention(*arrays, **scales, causal=N > 1, return_lse=True, backend="cpu")
    assert np.array_equal(out.numpy(), want) and np.array_equal(lse.numpy(), want_lse)
    reference = enp.attention(*arrays, **scales, causal=N > 1, backend="reference")
    assert np.abs(out.numpy() - reference).max() <= 1e-5
    assert [_bits(x) for x in tensors] == before


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_read_in_place_through_its_bits(dtype):
    k = torch.randn(2, 3, 5, 4).to(dtype).transpose(1, 2)  # strided: read as it is
    array = _arrays.to_numpy(k)
    assert array.dtype == DTYPES[dtype] and array.ctypes.data == k.data_ptr()
    assert np.array_equal(array.astype(np.float32), k.float().numpy())
    back = _arrays.from_numpy(array)
    assert back.dtype == dtype and back.data_ptr() == k.data_ptr() and _bits(back) == _bits(k)


def test_the_bnhd_layout_and_a_bfloat16_q():
    rng = np.random.default_rng(5)
    q = torch.from_numpy(rng.standard_normal((B, 6, H, 32)).astype(np.float32)).to(torch.bfloat16)
    k, v = (torch.from_numpy(rng.standard_normal((B, M, Hkv, 32)).astype(np.float32)) for _ in range(2))
    (k, k_scale), (v, v_scale) = (enpt.quantize_kv(x, "float8_e4m3fn", scale="token", layout="bnhd")
                                  for x in (k, v))
    out = enpt.attention(q, k, v, k_scale=k_scale, v_scale=v_scale, layout="bnhd")
    want = enp.attention(_arrays.to_numpy(q), _numpy(k), _numpy(v), k_scale=k_scale.numpy(),
                         v_scale=v_scale.numpy(), layout="bnhd", backend="cpu")
    assert out.dtype == torch.bfloat16 and _bits(out) == _bits(torch.from_numpy(want.astype(np.float32)).bfloat16())


def test_the_operator_takes_a_float8_cache():
    q, k, v, k_scale, v_scale = _cache(3, 32, torch.float8_e5m2, "head", None)
    fixed, learnable = common.split(_spec.complete({"k_scale": k_scale, "v_scale": v_scale}, "test"))
    args = _ops.op_arguments(fixed, learnable)
    torch.library.opcheck(torch.ops.elastic_np.attention.default, (q, k, v, *args, "cpu"),
                          test_utils="test_faketensor")  # test_schema does arithmetic torch lacks for float8
    out, _ = torch.ops.elastic_np.attention(q, k, v, *args, "cpu")
    assert torch.equal(out, enpt.attention(q, k, v, k_scale=k_scale, v_scale=v_scale))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_no_gradient_flows_through_a_quantized_cache(dtype):
    q, k, v, k_scale, v_scale = _cache(3, 32, dtype, "head", None)
    q.requires_grad_()
    out = enpt.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(TypeError, match=f"no gradient through a quantized cache: `k` and `v` are {str(dtype)[6:]}"):
        out.sum().backward()
    if dtype != torch.int8:  # an int8 tensor cannot require grad
        out = enpt.attention(q.detach(), k.requires_grad_(), v, k_scale=k_scale, v_scale=v_scale)
        with pytest.raises(TypeError, match="no gradient through a quantized cache"):
            out.sum().backward()


def test_float8_q_options_and_unscaled_caches_are_refused():
    q, k, v, k_scale, v_scale = _cache(3, 32, torch.float8_e4m3fn, "head", None)
    with pytest.raises(TypeError, match=r"`q` has dtype torch.float8_e4m3fn.*\.float\(\)"):
        enpt.attention(k, k, v, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(TypeError, match=r"`tau` has dtype torch.float8_e4m3fn.*\.float\(\)"):
        enpt.attention(q, k, v, k_scale=k_scale, v_scale=v_scale, tau=torch.ones((), dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"`k` is a quantized cache \(float8_e4m3fn\): pass its scale `k_scale`"):
        enpt.attention(q, k, v, v_scale=v_scale)
    with pytest.raises(TypeError, match="`k` and `v` must both be quantized"):
        enpt.attention(q, k, v.float(), k_scale=k_scale)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale, group_size", SCALES, ids=[s for s, _ in SCALES])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_quantize_kv_is_the_numpy_call(dtype, scale, group_size, xdtype):
    x = (torch.randn(2, 3, 7, 32, generator=torch.Generator().manual_seed(7)) * 3).to(xdtype)
    before = _bits(x)
    name = str(dtype)[6:]
    for given in (dtype, name):
        data, got_scale = enpt.quantize_kv(x, given, scale=scale, group_size=group_size)
        want, want_scale = enp.quantize_kv(x.float().numpy(), name, scale=scale, group_size=group_size)
        assert data.dtype == dtype and got_scale.dtype == torch.float32 and data.shape == x.shape
        assert _numpy(data).tobytes() == want.tobytes()
        assert got_scale.shape == want_scale.shape and np.array_equal(got_scale.numpy(), want_scale)
    assert _bits(x) == before


def test_quantize_kv_in_the_bnhd_layout_and_float64():
    x = torch.randn(2, 7, 3, 16, dtype=torch.float64, requires_grad=True)
    data, scale = enpt.quantize_kv(x, torch.int8, layout="bnhd")
    want, want_scale = enp.quantize_kv(x.detach().numpy(), "int8", layout="bnhd")
    assert np.array_equal(data.numpy(), want) and np.array_equal(scale.numpy(), want_scale)
    assert scale.shape == (3,) and not data.requires_grad


def test_quantize_kv_refuses_what_it_cannot_quantize():
    x = torch.randn(1, 2, 3, 4)
    for dtype in (torch.float16, torch.uint8, "int4", np.int8):
        with pytest.raises(TypeError, match="`dtype` must be one of torch.int8, torch.float8_e4m3fn"):
            enpt.quantize_kv(x, dtype)
    with pytest.raises(TypeError, match="`x` must be a torch.Tensor"):
        enpt.quantize_kv(x.numpy(), torch.int8)
    with pytest.raises(TypeError, match="`x` has dtype torch.int32"):
        enpt.quantize_kv(torch.ones(1, 2, 3, 4, dtype=torch.int32), torch.int8)
    with pytest.raises(TypeError, match="`x` is on device meta"):
        enpt.quantize_kv(x.to("meta"), torch.int8)
    with pytest.raises(ValueError, match="`group_size` 3 must divide"):
        enpt.quantize_kv(x, torch.int8, scale="group", group_size=3)
