"""`elastic_np.warmup` and `elastic-np warmup`; the INFO line of a first compile."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

import elastic_np as enp
from elastic_np._api import compile_report
from elastic_np._api.warmup import Warmup as _Report
from elastic_np.cli import main

# Later calls of a warmed configuration must neither compile nor load from
# the cache: both take Numba's compiler lock, which an already loaded kernel
# does not. Every path, in shapes and head counts of their own: padded
# batches in both layouts (prefill, decode of 1, 3 and 16 queries), packed
# sequences (a prefill, decodes of 1 and 16 queries) and their backward,
# paged caches (1 and 16 queries a sequence; one call for all, and one a
# sequence with a bias); each with the common options, the score modifiers,
# the bias and its gradient, the dynamic window.
LATER_CALLS = r"""
import sys
import numpy as np
from numba.core import event
import elastic_np as enp

if sys.argv[1] == "warm":
    enp.warmup(dtypes=["float32"])
rng = np.random.default_rng(1)
H, HKV, D = 4, 2, 40


def arrays(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def stages(bias):
    return ({}, {"causal": True, "tau": 0.7, "beta": 0.5, "nvm": True, "window_size": (50, 0)},
            {"softcap": 20.0, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])}, {"bias": bias},
            {"dynamic_window": enp.DynamicWindow(np.full(H, 0.8))})


def padded(N, M, layout):
    if layout == "bnhd":
        return arrays(2, N, H, D), arrays(2, M, HKV, D), arrays(2, M, HKV, D)
    return arrays(2, H, N, D), arrays(2, HKV, M, D), arrays(2, HKV, M, D)


with event.install_recorder("numba:compiler_lock") as recorder:
    for layout in ("bhnd", "bnhd"):
        for N, M in ((300, 280), (1, 700), (3, 700), (16, 700)):
            q, k, v = padded(N, M, layout)
            for options in stages(rng.standard_normal((1, H, N, M))):
                out, lse = enp.attention(q, k, v, return_lse=True, layout=layout, **options)
                enp.attention_backward(np.ones_like(out), q, k, v, out, lse, layout=layout, **options)
    cu_q, cu_k = np.array([0, 300, 301, 317]), np.array([0, 280, 980, 1680])
    q, k, v = arrays(317, H, D), arrays(1680, HKV, D), arrays(1680, HKV, D)
    for options in stages([rng.standard_normal((H, n, m)) for n, m in ((300, 280), (1, 700), (16, 700))]):
        out, lse = enp.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **options)
        enp.varlen_attention_backward(np.ones_like(out), q, k, v, out, lse, cu_q, cu_k, **options)
    pages, table, used = arrays(30, 32, HKV, D), np.arange(30).reshape(3, 10)[::-1], np.array([300, 17, 260])
    for n in (1, 16):
        for options in stages([rng.standard_normal((H, n, m)) for m in used]):
            for paged in ({name: value for name, value in options.items() if name != "bias"}, options):
                enp.varlen_attention(arrays(3 * n, H, D), pages, pages, np.arange(4) * n, None, block_table=table,
                                     seqused_k=used, **paged)
print(len(recorder.buffer))
"""


# The same for second derivatives after ``warmup(second_order=True)``, in both layouts.
LATER_SECOND_ORDER_CALLS = r"""
import sys
import numpy as np
from numba.core import event
import elastic_np as enp

if sys.argv[1] == "warm":
    enp.warmup(dtypes=["float32"], second_order=True)
rng = np.random.default_rng(1)
with event.install_recorder("numba:compiler_lock") as recorder:
    for N, M, layout in ((300, 280, "bhnd"), (5, 70, "bhnd"), (1, 70, "bnhd"), (40, 30, "bnhd")):
        axes = (2, N, 4, 40) if layout == "bnhd" else (2, 4, N, 40)
        q, ddq = (rng.standard_normal(axes).astype(np.float32) for _ in range(2))
        axes = (2, M, 2, 40) if layout == "bnhd" else (2, 2, M, 40)
        k, v = (rng.standard_normal(axes).astype(np.float32) for _ in range(2))
        for options in ({}, {"causal": True, "tau": 0.7, "beta": 0.5, "nvm": True},
                        {"softcap": 20.0, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])},
                        {"bias": rng.standard_normal((1, 4, N, M))}, {"dynamic_window": enp.DynamicWindow(0.8)}):
            out, lse = enp.attention(q, k, v, return_lse=True, layout=layout, **options)
            enp.attention_double_backward(ddq, None, None, np.ones_like(out), q, k, v, out, lse, layout=layout,
                                          **options)
print(len(recorder.buffer))
"""


# The same for quantized caches after ``warmup(caches=...)``: int8 (float8's kernels are the same code for other
# bytes), every kind of scale (per head, float32 per token, float16 per group; float32 per group and float16 per
# token share their kernels), decode and prefill, both layouts, and pages.
LATER_CACHE_CALLS = r"""
import sys
import numpy as np
from numba.core import event
import elastic_np as enp

if sys.argv[1] == "warm":
    enp.warmup(dtypes=["float32"], options=["causal"], caches=["int8"])
rng = np.random.default_rng(1)
with event.install_recorder("numba:compiler_lock") as recorder:
    for fmt in ("int8",):
        for scale, scale_dtype in (("head", "float32"), ("token", "float32"), ("group", "float16"),
                                   ("group", "float32"), ("token", "float16")):
            for layout, (N, M) in (("bhnd", (1, 900)), ("bnhd", (3, 900)), ("bhnd", (60, 90)), ("bnhd", (40, 70))):
                q = rng.standard_normal((2, N, 4, 64) if layout == "bnhd" else (2, 4, N, 64)).astype(np.float32)
                cache = rng.standard_normal((2, M, 2, 64) if layout == "bnhd" else (2, 2, M, 64))
                data, factor = enp.quantize_kv(cache, fmt, scale=scale, layout=layout,
                                               group_size=16 if scale == "group" else None)
                factor = factor.astype(scale_dtype)
                enp.attention(q, data, data, k_scale=factor, v_scale=factor, causal=True, layout=layout)
            pages = rng.standard_normal((30, 16, 2, 64))
            data, factor = enp.quantize_kv(pages, fmt, scale=scale, layout="bnhd",
                                           group_size=16 if scale == "group" else None)
            factor = factor.astype(scale_dtype)
            for n in (1, 30):
                enp.varlen_attention(rng.standard_normal((2 * n, 4, 64)).astype(np.float32), data, data,
                                     np.arange(3) * n, None, block_table=np.arange(30).reshape(2, 15),
                                     seqused_k=[200, 37], k_scale=factor, v_scale=factor)
print(len(recorder.buffer))
"""


def _compiler_lock_events(mode, script=LATER_CALLS):
    run = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1])


def test_after_warmup_later_calls_neither_compile_nor_load():
    assert _compiler_lock_events("warm") == 0


def test_without_warmup_the_same_calls_load_or_compile():
    # the control: the count above can fail
    assert _compiler_lock_events("cold") > 0


def test_after_a_second_order_warmup_later_double_backwards_neither_compile_nor_load():
    assert _compiler_lock_events("warm", LATER_SECOND_ORDER_CALLS) == 0
    assert _compiler_lock_events("cold", LATER_SECOND_ORDER_CALLS) > 0  # the control


def test_after_a_cache_warmup_later_quantized_calls_neither_compile_nor_load():
    assert _compiler_lock_events("warm", LATER_CACHE_CALLS) == 0
    assert _compiler_lock_events("cold", LATER_CACHE_CALLS) > 0  # the control


def test_a_cache_warmup_reports_a_path_per_format_and_checks_them():
    report = enp.warmup(dtypes=["float64", "float32"], options=["causal"], backend="cpu", caches="int8")
    assert ("float32", "int8 cache") in report.seconds and ("float64", "int8 cache") not in report.seconds
    assert "int8 cache" not in {path for _, path in enp.warmup(dtypes=["float32"], backend="reference",
                                                                caches=["int8"]).seconds}
    with pytest.raises(ValueError, match="`caches` must name quantized formats.*int4"):
        enp.warmup(dtypes=["float32"], caches=["int4"])


def test_second_order_warmup_reports_its_path_and_needs_a_double_backward(monkeypatch):
    report = enp.warmup(dtypes=["float64"], options=["causal"], backend="cpu", second_order=True)
    assert ("float64", "double backward") in report.seconds
    monkeypatch.delattr(enp.cpu, "double_backward")
    with pytest.raises(enp.BackendUnavailableError, match="'cpu' has no double backward.*second_order"):
        enp.warmup(dtypes=["float64"], backend="cpu", second_order=True)


def test_warmup_reports_each_path_and_checks_its_arguments():
    report = enp.warmup(dtypes=["float64"], options=["causal", "softcap"], backend="cpu")
    assert list(report.seconds) == [("float64", path) for path in
                                    ("prefill", "decode", "decode, 16 queries", "packed", "paged")]
    assert all(s >= 0 for s in report.seconds.values()) and report.compiled >= 0
    with pytest.raises(ValueError, match="`options` must name options of `attention`.*is_causal"):
        enp.warmup(options=["is_causal"])
    with pytest.raises(ValueError, match="`dtypes`.*float128"):
        enp.warmup(dtypes=[np.longdouble], backend="cpu")
    with pytest.raises(ValueError, match="`head_dim`"):
        enp.warmup(head_dim=0)


def test_warmup_reference_compiles_nothing():
    report = enp.warmup(dtypes=["float32"], backend="reference")
    assert report.compiled == 0


def test_a_compile_is_one_info_line_naming_it(caplog):
    @njit(fastmath=False)
    def never_seen(x):
        return x + 1

    with caplog.at_level(logging.INFO, logger="elastic_np"):
        with compile_report.reported("cpu", "forward", np.dtype(np.float32)) as seen:
            never_seen(np.float32(1.0))
        with compile_report.reported("cpu", "forward", np.dtype(np.float32)):
            never_seen(np.float32(2.0))  # compiled already: no line
    records = [r for r in caplog.records if r.name == "elastic_np" and r.levelno == logging.INFO]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert message.startswith("cpu backend: forward for float32: compiled 1 function")
    assert "never_seen" in " ".join(str(n) for n in seen.compiled)
    assert "no compile" in compile_report.Watch().summary()


def test_cli_warmup(capsys, monkeypatch):
    assert main(["warmup", "--dtype", "float32", "--options", "causal", "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "float32  prefill" in out and "decode, 16 queries" in out
    assert "compiled" in out or "nothing compiled" in out
    assert main(["warmup", "--dtype", "float32", "--options", "causal", "--backend", "cpu", "--second-order"]) == 0
    assert "float32  double backward" in capsys.readouterr().out
    import elastic_np.cli as cli

    asked = []
    monkeypatch.setattr(cli, "warmup", lambda **kw: asked.append(kw) or _Report({("float32", "int8 cache"): 1.0}, 0))
    assert main(["warmup", "--dtype", "float32", "--backend", "cpu", "--caches", "int8", "float8_e5m2"]) == 0
    assert asked[-1]["caches"] == ["int8", "float8_e5m2"] and "float32  int8 cache" in capsys.readouterr().out
    monkeypatch.undo()
    assert main(["warmup", "--options", "dropout_p"]) == 2
    assert "`options` must name options" in capsys.readouterr().err


def test_importing_and_warming_the_reference_imports_no_tool():
    code = "import sys, elastic_np as e; e.warmup(backend='reference'); print('elastic_np.cli' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert run.stdout.strip() == "False", run.stderr
