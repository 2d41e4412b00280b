"""The bfloat16 prefill forward on AMX tiles (`elastic_np.cpu._prefill.forward_amx`), where this CPU has them.

Every call is held to the kit's rule against the float64 oracle, and to the
float32 products of the same kernels (``config.AMX`` off): ``lse`` to
float32 rounding and ``out`` to one unit of bfloat16 in the last place (plus
what the split of ``p`` may move), for every option, layout and edge of the
tiles. (The kit's own cases, ``tests/cpu/test_halves.py``, have head dims the
tiles do not take.)
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from elastic_np.cpu._prefill import forward_amx as _forward_amx
from elastic_np.cpu._tiles import amx as _amx
from elastic_np.testing._report import worst_error
from elastic_np.testing._tolerances import kit_allowed, naive_orderings, rounding_allowance

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

needs_amx = pytest.mark.skipif(not (_amx.AVAILABLE and _amx.permitted()), reason="this CPU has no AMX tiles")


def _draw(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(BF16)


def _assert_within_rule(q, k, v, out, lse, **options):
    """``out`` and ``lse`` within the kit's bfloat16 rule against the float64 oracle (`elastic_np.testing.check_attention`)."""
    wide = [a.astype(np.float64) for a in (q, k, v)]
    if "bias" in options:
        options = dict(options, bias=options["bias"].astype(np.float64))
    want = enp.attention(*wide, return_lse=True, backend="reference", **options)
    dout = np.zeros_like(want[0])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        naive = naive_orderings(*wide, dout, options, BF16, backward=False)
        rounding = rounding_allowance(*wide, dout, options, dtype=BF16)
    for name, got, ref in (("out", out, want[0]), ("lse", lse, want[1])):
        error, note = worst_error(got, ref)
        allowed, _ = kit_allowed(ref, [n[name] for n in naive], BF16, rounding[name])
        assert error <= allowed, (name, error, allowed, note)


def _both(monkeypatch, q, k, v, rule=True, **options):
    """``((out, lse) on the tiles, (out, lse) with the float32 products)``, checking which path each took.

    The tiles' result is held to the kit's rule (`_assert_within_rule`) with ``rule``.
    """
    calls = []
    forward = _forward_amx.forward
    monkeypatch.setattr(_forward_amx, "forward", lambda problem: calls.append(1) or forward(problem))
    tiles = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
    assert calls, "the tiles' path was not taken"
    if rule:
        _assert_within_rule(q, k, v, *tiles, **options)
    monkeypatch.setattr(cpu._runtime.config, "AMX", False)
    products = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
    assert len(calls) == 1
    monkeypatch.setattr(cpu._runtime.config, "AMX", True)
    return tiles, products


def _ulp(x):
    """One unit in the last place of bfloat16 at ``|x|`` (float64), the smallest normal's below it."""
    exponent = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126)))
    return 2.0 ** (exponent - 7)


def _assert_agree(tiles, products, v):
    """``out`` within a unit of bfloat16 of the float32 products', plus what carrying ``p`` to ``2**-16`` of itself moves.

    That is at most ``2**-16 sum_j p_j |v_j| <= 2**-16 max |v|`` before the
    rounding to bfloat16 (the sums' order moves it by float32 roundings).
    """
    (out, lse), (out32, lse32) = tiles, products
    assert out.dtype == BF16 and lse.dtype == np.float32
    a, b = out.astype(np.float64), out32.astype(np.float64)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    split = 2.0 ** -15 * np.abs(v.astype(np.float64)).max()
    np.testing.assert_array_less(np.abs(a - b), _ulp(np.maximum(np.abs(a), np.abs(b))) * 1.0001 + split)
    np.testing.assert_allclose(lse, lse32, rtol=2e-6, atol=2e-6)


# (B, H, Hkv, N, M, D, Dv): one tile each way, edges of every tile, grouped heads, head dims 32 to 128
SHAPES = [(1, 2, 1, 64, 64, 64, 64), (2, 4, 2, 70, 150, 32, 32), (1, 4, 2, 200, 333, 128, 64),
          (1, 2, 2, 33, 31, 96, 96)]


@needs_amx
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tiles", ["default tiles", "32 x 64 tiles"])
def test_the_tiles_agree_with_the_float32_products(monkeypatch, shape, tiles):
    if tiles != "default tiles":
        monkeypatch.setattr(cpu._runtime.config, "BLOCK_Q", 32)
        monkeypatch.setattr(cpu._runtime.config, "BLOCK_K", 64)
    B, H, Hkv, N, M, D, Dv = shape
    q, k, v = _draw((B, H, N, D), 1), _draw((B, Hkv, M, D), 2), _draw((B, Hkv, M, Dv), 3)
    _assert_agree(*_both(monkeypatch, q, k, v), v)


OPTIONS = {
    "causal": dict(causal=True),
    "window": dict(window_size=(40, 7)),
    "kv_lengths": dict(kv_lengths=np.array([150, 77]), causal=True, align="kv_lengths"),
    "tau beta": dict(tau=np.array([0.5, 1.0, 1.5, 2.0]), beta=np.array([0.0, 0.5, 1.0, 3.0]), scale=0.3),
    "softcap alibi": dict(softcap=4.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4])),
    "bias": dict(bias=_draw((1, 4, 70, 150), 7)),
    "mask": dict(mask=np.random.default_rng(8).random((2, 1, 70, 150)) > 0.3),
    "dynamic window": dict(dynamic_window=enp.DynamicWindow(np.array([0.2, 0.3, 0.4, 0.5]), sharpness=3.0, threshold=0.2),
                           causal=True),
}


@needs_amx
@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_on_the_tiles(monkeypatch, name):
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_Q", 32)
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_K", 64)
    q, k, v = _draw((2, 4, 70, 32), 1), _draw((2, 2, 150, 32), 2), _draw((2, 2, 150, 32), 3)
    _assert_agree(*_both(monkeypatch, q, k, v, **OPTIONS[name]), v)


@needs_amx
def test_the_tiles_read_the_flash_layout_in_place(monkeypatch):
    q, k, v = (_draw((2, n, h, 64), s).transpose(0, 2, 1, 3) for n, h, s in ((90, 4, 1), (130, 2, 2), (130, 2, 3)))
    tiles, products = _both(monkeypatch, q, k, v, causal=True)
    _assert_agree(tiles, products, v)
    assert tiles[0].transpose(0, 2, 1, 3).flags.c_contiguous  # out in the layout of q


@needs_amx
def test_padding_past_kv_lengths_is_never_read(monkeypatch):
    """NaN and inf past a sequence's length, in the keys a tile's last 32 would span: out as with zeros there."""
    q, k, v = _draw((2, 2, 40, 32), 1), _draw((2, 2, 100, 32), 2), _draw((2, 2, 100, 32), 3)
    lengths = np.array([100, 45])
    clean = _both(monkeypatch, q, k, v, kv_lengths=lengths)
    k[1, :, 45:], v[1, :, 45:] = np.nan, np.inf
    dirty = _both(monkeypatch, q, k, v, rule=False, kv_lengths=lengths)  # the oracle reads the padding
    for a, b in zip(dirty[0], clean[0]):
        np.testing.assert_array_equal(a, b)
    _assert_agree(*dirty, v)
    # tiny values with huge ones in the padding: scaled as if the padding were not there
    v[1, :, :45] = (v[1, :, :45].astype(np.float32) * np.float32(2.0 ** -121)).astype(BF16)
    v[1, :, 45:] = 1e30
    tiles, products = _both(monkeypatch, q, k, v, rule=False, kv_lengths=lengths)
    want = enp.attention(q, k[:, :, :45], v[:, :, :45], backend="reference", kv_lengths=np.array([45, 45]))
    np.testing.assert_allclose(tiles[0][1].astype(np.float64), want[1], rtol=2.0 ** -7, atol=2.0 ** -7 * np.abs(want[1]).max())


@needs_amx
def test_large_logits(monkeypatch):
    q, k, v = _draw((1, 2, 50, 64), 1, 8.0), _draw((1, 2, 80, 64), 2, 8.0), _draw((1, 2, 80, 64), 3)
    _assert_agree(*_both(monkeypatch, q, k, v), v)


@needs_amx
@pytest.mark.parametrize("scale", [2.0 ** -100, 2.0 ** -125, 2.0 ** -132])
def test_tiny_values(monkeypatch, scale):
    """Values whose products with ``p`` fall below float32's smallest normal, which the unit writes as zero.

    One key with ``p`` near 1, the others near 0.005: flushed, their share
    of ``out`` (about nine tenths) would be lost. The head is scaled up on
    the tiles (`_forward_amx.values_transposed`); the second head is not.
    """
    q, k = np.zeros((1, 2, 64, 64), np.float32), np.zeros((1, 2, 2048, 64), np.float32)
    q[..., 0], k[..., 0] = 1.0, 8 * np.log(0.005)
    k[:, :, 0, 0] = 0.0
    v = np.ones((1, 2, 2048, 64), np.float32) + _draw((1, 2, 2048, 64), 3).astype(np.float32) / 4
    v[:, 0] *= np.float32(scale)
    q, k, v = (a.astype(BF16) for a in (q, k, v))
    tiles, products = _both(monkeypatch, q, k, v)
    _, unscale = _forward_amx.values_transposed(v, np.array([2048]))
    largest = np.abs(v[0, 0].astype(np.float64)).max()
    assert unscale[0] == 2.0 ** np.floor(np.log2(largest)) and unscale[1] == 1
    for got, want in zip(tiles[0][0].astype(np.float64), products[0][0].astype(np.float64)):
        np.testing.assert_allclose(got, want, rtol=2.0 ** -7)


@needs_amx
def test_an_overflowing_product_takes_the_float32_products(monkeypatch):
    """Unscaled ``q . k`` beyond float32 where ``q scale / tau`` is not: the tiles' result is dropped for the float32 products'."""
    q, k, v = _draw((1, 1, 40, 64), 1, 1e19), _draw((1, 1, 60, 64), 2, 1e19), _draw((1, 1, 60, 64), 3)
    tiles, products = _both(monkeypatch, q, k, v, tau=np.array([1e30]))
    for a, b in zip(tiles, products):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(tiles[1]).all()


@needs_amx
@pytest.mark.parametrize("shape", [(0, 2, 1, 40, 50, 64, 64), (1, 2, 1, 40, 50, 64, 0), (1, 2, 1, 40, 0, 64, 64)],
                         ids=["B=0", "Dv=0", "M=0"])
def test_empty_problems(monkeypatch, shape):
    B, H, Hkv, N, M, D, Dv = shape
    q, k, v = _draw((B, H, N, D), 1), _draw((B, Hkv, M, D), 2), _draw((B, Hkv, M, Dv), 3)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    monkeypatch.setattr(cpu._runtime.config, "AMX", False)
    out32, lse32 = enp.attention(q, k, v, return_lse=True, backend="cpu")
    assert out.shape == out32.shape == (B, H, N, Dv) and out.dtype == BF16
    np.testing.assert_allclose(lse, lse32, rtol=2e-6)


@needs_amx
def test_the_tiles_bits_do_not_depend_on_the_threads(monkeypatch):
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_Q", 32)
    monkeypatch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
    q, k, v = _draw((2, 4, 200, 64), 1), _draw((2, 2, 300, 64), 2), _draw((2, 2, 300, 64), 3)
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(cpu._runtime.threads, "thread_count", lambda threads=threads: threads)
        results.append(enp.attention(q, k, v, return_lse=True, backend="cpu", causal=True))
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out.view(np.uint16), results[0][0].view(np.uint16))
        np.testing.assert_array_equal(lse, results[0][1])


def _problem(dtype=BF16, D=64, Dv=64, **options):
    q = np.zeros((1, 2, 40, D), dtype)
    kv = np.zeros((1, 2, 50, D), dtype), np.zeros((1, 2, 50, Dv), dtype)
    return cpu.prepare(q, *kv, dtypes=cpu.dtypes, **options)


def test_which_problems_the_tiles_take(monkeypatch):
    """bfloat16 without NVM and with head dims of whole chunks, on a CPU with the tiles, unless turned off."""
    on = _amx.AVAILABLE and _amx.permitted()
    assert _forward_amx.takes(_problem()) == on
    assert _forward_amx.takes(_problem(D=96, Dv=32, causal=True)) == on
    assert not _forward_amx.takes(_problem(nvm=True))  # a flushed -1e-40 would pass NVM's test as +0
    assert not _forward_amx.takes(_problem(D=48))
    assert not _forward_amx.takes(_problem(Dv=48))
    assert not _forward_amx.takes(_problem(dtype=np.float16))
    assert not _forward_amx.takes(_problem(dtype=np.float32))
    monkeypatch.setattr(cpu._runtime.config, "AMX", False)
    assert not _forward_amx.takes(_problem())
    monkeypatch.setattr(cpu._runtime.config, "AMX", True)
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_K", 40)
    assert not _forward_amx.takes(_problem())


def test_no_tiles_without_the_cpu_feature(monkeypatch):
    """Where LLVM does not compile for AMX, nothing asks Linux for the tiles and no problem takes them."""
    monkeypatch.setattr(_amx, "AVAILABLE", False)
    monkeypatch.setattr(_amx, "_PERMISSION", [])
    assert not _amx.permitted() and _amx._PERMISSION == []
    assert not _forward_amx.takes(_problem())


@needs_amx
def test_mixed_layouts(monkeypatch):
    """``q`` and ``v`` stored ``(B, N, H, D)``, ``k`` ``(B, H, N, D)``: each read in place."""
    q = _draw((2, 90, 4, 64), 1).transpose(0, 2, 1, 3)
    k = _draw((2, 2, 130, 64), 2)
    v = _draw((2, 130, 2, 64), 3).transpose(0, 2, 1, 3)
    _assert_agree(*_both(monkeypatch, q, k, v, causal=True), v)


@needs_amx
def test_concurrent_calls_from_python_threads(monkeypatch):
    """Each thread configures its own tiles: calls from four Python threads at once give the bits of calls one by one."""
    import concurrent.futures

    monkeypatch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
    problems = [(_draw((1, 4, 150, 64), s), _draw((1, 2, 200, 64), s + 10), _draw((1, 2, 200, 64), s + 20))
                for s in range(4)]

    def run(inputs):
        return enp.attention(*inputs, return_lse=True, backend="cpu", causal=True)

    one_by_one = [run(p) for p in problems]
    with concurrent.futures.ThreadPoolExecutor(4) as callers:
        at_once = list(callers.map(run, problems * 2))
    for (out_a, lse_a), (out_b, lse_b) in zip(one_by_one * 2, at_once):
        np.testing.assert_array_equal(out_a.view(np.uint16), out_b.view(np.uint16))
        np.testing.assert_array_equal(lse_a, lse_b)
