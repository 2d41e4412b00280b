"""The first hour of a PyTorch or FlashAttention user, replayed: each stumble a new user met, as a test.

The walkthrough tried the README, every docs page, the CLI, the adapters and
common mistakes; each test below is one of the places a newcomer tripped,
checked the way the newcomer met it.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import testing
from elastic_np.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAS_TORCH = importlib.util.find_spec("torch") is not None

FIRST_CALL = """
import logging, numpy as np, elastic_np as enp
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
q = np.ones((1, 2, 40, 8), np.float32)
enp.attention(q, q, q, backend="cpu")
"""


def test_1_a_first_compile_says_what_it_compiles_and_how_long(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("elastic_np INFO")]
    assert len(lines) == 1 and re.search(r"cpu backend: forward for float32: compiled \d+ functions "
                                         r"\(forward_kernel\) in \d+\.\d s", lines[0]), run.stderr
    assert run.stdout == ""  # never print
    assert callable(enp.warmup)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_2_elastic_attention_starts_as_sdpa_and_names_what_the_user_passed():
    import torch

    from elastic_np.torch import ElasticAttention

    q, k, v = (torch.randn(1, 8, 12, 16, dtype=torch.float64) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ElasticAttention(8, causal=True)(q, k, v), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="learn_beta"):
        ElasticAttention(8, beta=0.0, learn_beta=True)
    with pytest.raises(ValueError, match="num_heads=4"):
        ElasticAttention(4)(q, k, v)


@pytest.mark.parametrize("name, ours", [("is_causal", "causal="), ("attn_mask", "bias="),
                                        ("softmax_scale", "scale="), ("dropout_p", "not supported")])
def test_3_foreign_names_say_which_of_ours_to_use(name, ours):
    q = np.ones((1, 1, 4, 8))
    with pytest.raises(TypeError, match=re.escape(ours)):
        enp.attention(q, q, q, **{name: True})


def test_3_a_float_mask_points_to_bias():
    q = np.ones((1, 1, 4, 8))
    with pytest.raises(TypeError, match="bias="):
        enp.attention(q, q, q, mask=np.zeros((4, 4)))


def test_4_flash_attention_arrays_are_read_as_declared():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 16, 4, 8)) for _ in range(3))  # (B, N, H, D)
    out = enp.attention(q, k, v, layout="bnhd", causal=True, backend="reference")
    by_heads = [enp.attention(*(np.ascontiguousarray(a[:, :, h:h + 1].transpose(0, 2, 1, 3)) for a in (q, k, v)),
                              causal=True, backend="reference") for h in range(4)]
    np.testing.assert_array_equal(out, np.concatenate(by_heads, axis=1).transpose(0, 2, 1, 3))


def test_5_the_docs_agree_with_each_other_and_with_the_code():
    readme = (ROOT / "README.md").read_text()
    pages = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.rst")}
    # what ran on a GPU: the README and the frameworks page tell the same story
    assert "H100" in readme and "run on an H100" in pages["frameworks.rst"]
    # compile times live in the first-run text (README, getting_started, performance), not in dask.rst
    assert not re.search(r"\d+-\d+ s", pages["dask.rst"].split("Compiled kernels")[1][:400])
    assert "client.run(elastic_np.warmup)" in pages["dask.rst"]
    for extra in ("torch", "jax", "dask"):
        assert f"* - ``{extra}``" in pages["getting_started.rst"]
    assert "``dbias``" in pages["testing_kernels.rst"] and "``reference``" in pages["testing_kernels.rst"]
    # on GitHub the CLI help and the performance tables are text, not include directives
    assert ".. include::" not in pages["getting_started.rst"] + pages["performance.rst"]


def test_6_benchmarks_measure_what_they_say(capsys):
    from elastic_np.cli import _bench_decode

    assert main(["bench", "--quick", "--seq", "8", "--heads", "1", "--dim", "4", "--repeat", "1",
                 "--min-time", "0"]) == 0
    out = capsys.readouterr().out
    assert "; 1 thread (kernels" in out.splitlines()[0]  # the thread counts, set and printed
    assert re.search(r"first call \d+\.\d+ s \((compiled \d+ function|no compile: loaded)", out)
    main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for shape in _bench_decode.QUICK_SHAPES:
        assert ",".join(map(str, shape)) in help_text


def test_7_a_strict_check_fails_on_skipped_cases_and_grads_print_a_summary():
    def plain(q, k, v):
        return enp.attention(q, k, v, backend="reference")

    report = testing.check_attention(plain, dtypes=(np.float64,))
    assert report and re.search(r"\d+/\d+ passed, \d+ cases skipped", str(report))
    assert not testing.check_attention(plain, dtypes=(np.float64,), strict=True)
    q = np.ones((1, 1, 3, 4))
    out, lse = enp.attention(q, q, q, return_lse=True, backend="reference")
    text = repr(enp.attention_backward(out, q, q, q, out, lse, backend="reference"))
    assert "dq" in text and "(1, 1, 3, 4)" in text and len(text) < 600


# The second walkthrough (a PyTorch and Hugging Face user on a 2-core CPU, in a fresh virtual environment).

NOTICE = r'''
import sys, types, warnings
import numba
import elastic_np as enp
from elastic_np._api import compile_report
if sys.argv[1] == "filtered":
    warnings.filterwarnings("ignore", category=enp.CompileWarning)
probe = types.ModuleType("elastic_np._first_hour_probe")  # its compiles count as the package's
sys.modules[probe.__name__] = probe
for n in range(2):  # two compiling calls
    exec(f"def f{n}(x):\n    return x + {n}\n", probe.__dict__)
    with compile_report.reported("cpu", "forward", "float32") as seen:
        numba.njit(fastmath=False)(getattr(probe, f"f{n}"))(1)
    assert seen.compiled
'''


def test_8_a_first_compile_is_announced_on_stderr_once_and_a_filter_silences_it():
    for mode, notices in (("shown", 1), ("filtered", 0)):
        run = subprocess.run([sys.executable, "-c", NOTICE, mode], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stderr.count(": CompileWarning: elastic_np is compiling the cpu backend's forward") == notices, \
            run.stderr
        assert ("elastic_np.warmup()" in run.stderr) == bool(notices)


def test_8_warmup_reports_every_path_it_covers():
    paths = {path for _, path in enp.warmup(dtypes=["float32"], backend="cpu").seconds}
    assert paths == {"prefill", "decode", "decode, 16 queries", "packed", "paged"}


def test_9_the_docs_say_which_dtypes_the_figures_come_from_files_and_torch_has_a_cpu_build():
    import runpy

    import elastic_np.cpu

    readme = (ROOT / "README.md").read_text()
    started = (ROOT / "docs" / "getting_started.rst").read_text()
    figures = runpy.run_path(str(ROOT / "docs" / "scripts" / "figures.py"))
    assert figures["stale"]() == [] and figures["used"]() == set(figures["FIGURES"])
    assert "eager bits" not in readme + (ROOT / "docs" / "models.rst").read_text()
    dtypes = started.split("Dtypes\n------")[1]
    assert all(name in dtypes for name in elastic_np.cpu.dtypes)
    cpu_build = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_build in readme and cpu_build in started


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_10_torch_varlen_attn_call_reads_the_same_and_dropout_zero_is_taken():
    import inspect

    import torch
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    import elastic_np.torch as enpt

    torch.manual_seed(0)
    q, k, v = (torch.randn(7, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse = enpt.varlen_attention(q, k, v, cu, cu, 4, 4, window_size=(-1, 0),
                                     return_aux=varlen.AuxRequest(lse=True))
    ours, our_lse = enpt.varlen_attention(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True,
                                          return_lse=True)
    assert torch.equal(out, ours) and torch.equal(lse, our_lse.T)  # torch's lse: (H, total_q)
    params = inspect.signature(enpt.varlen_attention).parameters
    assert list(params)[:7] == list(inspect.signature(varlen.varlen_attn).parameters)[:7]
    assert not {"layout", "kv_lengths", "align"} & set(params)
    x = torch.randn(1, 2, 4, 8)
    assert torch.equal(enpt.attention(x, x, x, dropout_p=0.0), enpt.attention(x, x, x))
    with pytest.raises(ValueError, match="dropout is not supported"):
        enpt.attention(x, x, x, dropout_p=0.1)


def test_11_pages_in_the_per_head_order_are_named_by_their_shape():
    k = np.zeros((4, 8, 16, 8), np.float32)  # (num_blocks, Hkv, block_size, D): vLLM's per-head order
    q = np.zeros((2, 32, 8), np.float32)
    with pytest.raises(ValueError, match=re.escape("must be pages of shape (num_blocks, block_size, Hkv, D), "
                                                   "got `k` of shape (4, 8, 16, 8)") + ".*per-head order"):
        enp.varlen_attention(q, k, k, [0, 1, 2], None, block_table=[[0, 1], [2, 3]], seqused_k=[20, 7])


def test_12_the_cli_tells_compiled_from_loaded_writes_plain_lines_off_a_terminal_and_takes_bfloat16(monkeypatch):
    import io

    import numba

    from elastic_np.cli import _bench
    from elastic_np.cli._progress import Progress

    jitted = numba.njit(cache=False, fastmath=False)(lambda x: x + 1)
    impls = {"elastic_np fake": (lambda *a: jitted(1.0), lambda *a: jitted(2.0))}
    said = []
    for _ in range(2):
        _bench._first_calls(impls, [8], 4, np.dtype(np.float32), lambda kind, message: said.append(message))
    assert said[0].endswith("compiling, or loading from Numba's cache")
    assert said[1].startswith("elastic_np fake: compiled 1 function in ")
    assert said[3].startswith("elastic_np fake: nothing compiled (loaded from Numba's cache")
    stream = io.StringIO()
    with Progress(100, "work", stream=stream, delay=0.0) as bar:
        for _ in range(100):
            bar.update()
    assert "\r" not in stream.getvalue() and len(stream.getvalue().splitlines()) == 4
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    with _bench.thread_counts(1) as counts:
        pass
    assert any("threadpoolctl" in n and "pip install threadpoolctl" in n for n in _bench.unset_notes(counts))
    run = _bench.compare([8], heads=1, dim=4, dtype="bfloat16", repeat=1, matmul_n=64, threads=1,
                         impls={k: v for k, v in _bench.implementations().items() if k != "elastic_np cuda"})
    assert run["config"]["dtype"] == "bfloat16" and run["config"]["peak_dtype"] == "float32"
    assert {r["impl"] for r in run["results"]} >= {"elastic_np cpu", "naive numpy"}
