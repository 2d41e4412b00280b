"""The ``elastic-np`` command line: check, bench, example, argument errors."""

import copy
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import elastic_np
from elastic_np import cli
from elastic_np.cli._progress import Progress
from elastic_np.testing import _cases


def available(name):
    if importlib.util.find_spec(f"elastic_np.{name}") is None:
        return False
    try:
        elastic_np._api.dispatch.get_backend(name)
    except elastic_np.BackendUnavailableError:
        return False
    return True


# ---------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------


#: `check`'s report of the oracle's gradients against central differences, by ``(quick, seed)`` (`oracle_gradients_once`).
_ORACLE_GRADIENTS = {}


@pytest.fixture(autouse=True)
def oracle_gradients_once(monkeypatch):
    """`check`'s float64 oracle gradients against central differences computed once in this process and replayed
    (its progress steps included) on the later checks: the report depends only on ``quick`` and ``seed`` (seeded
    float64 inputs, no backend), and takes about 10 s of every check. The first check of a process computes it, and
    the tests that read its rows (test_check_quick_reference) see them as computed; test_check_subprocess runs the
    whole check in a process of its own."""
    real = cli.check_oracle_gradients

    def once(*, quick=True, seed=0, progress=None):
        key = (quick, seed)
        if key not in _ORACLE_GRADIENTS:
            _ORACLE_GRADIENTS[key] = real(quick=quick, seed=seed)
        report = copy.deepcopy(_ORACLE_GRADIENTS[key])
        if progress is not None:
            for case in dict.fromkeys(row.case for row in report.rows):
                progress(case)
        return report

    monkeypatch.setattr(cli, "check_oracle_gradients", once)


#: A row of check's tables: case, dtype, quantity, worst error, allowed, result.
CHECK_ROW = re.compile(r"^  (.+?)\s+(b?float\d+)\s+([\w\[\]]+)\s+(\S+)\s+(\S+)\s+(pass|FAIL)\b")


def test_check_quick_reference(capsys):
    assert cli.main(["check", "--quick", "--backend", "reference", "--variants"]) == 0
    out = capsys.readouterr().out
    assert "backend 'reference' vs the float64 oracle" in out
    assert "float64 oracle gradients vs central differences" in out
    against_oracle, against_differences = out.split("backend 'reference' vs the float64 oracle")[1].split(
        "float64 oracle gradients vs central differences")
    for case in _cases.CASES:
        assert f"  {case.name} " in against_oracle
    assert "worst error" in out and "allowed" in out
    assert "FAIL" not in out
    rows = {}
    for name, table in (("oracle", against_oracle), ("differences", against_differences)):
        rows[name] = [row.groups() for row in map(CHECK_ROW.match, table.splitlines()) if row]
        for case, dtype, quantity, error, allowed, result in rows[name]:
            assert 0 <= float(error) <= float(allowed) and result == "pass", (case, dtype, quantity)
        assert f"  {len(rows[name])}/{len(rows[name])} passed" in table
    # the reference is the oracle: not a bit apart, in either dtype
    assert {float(row[3]) for row in rows["oracle"]} == {0.0}
    assert {row[1] for row in rows["oracle"]} == {"float32", "float64"}
    total = len(rows["oracle"]) + len(rows["differences"])
    assert out.strip().splitlines()[-1].startswith(f"PASS: {total} checks passed")


def test_a_users_variant_is_checked_when_asked(capsys):
    """Without ``--variants`` (test_check_quick_reference passes it), no case of a user's variant runs."""
    assert cli.main(["check", "--quick", "--backend", "reference", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "  plain " in out and "score_mod" not in out  # neither run nor listed as skipped
    assert cli.main(["check", "--help"]) == 0
    assert "--variants" in capsys.readouterr().out


def test_check_quick_all_reports_unavailable_backends_as_skipped(capsys):
    assert cli.main(["check", "--quick"]) == 0
    captured = capsys.readouterr()
    for name in ("cpu", "cuda"):
        if available(name):
            assert f"backend '{name}' vs the float64 oracle" in captured.out
            assert f"backend '{name}': first calls took" in captured.out
            assert f"{name}: first call of the kernels (float32, float64): compiling, or loading" in captured.err
            # and the line after it says which it was
            assert (f"\n{name}: compiled " in captured.err) != (f"\n{name}: nothing compiled (loaded" in captured.err)
        else:
            assert f"backend '{name}': skipped" in captured.out
    assert "float64 oracle gradients" in captured.out
    assert captured.out.strip().splitlines()[-1].startswith("PASS: ")
    assert "\r" not in captured.err and "first JIT compile" not in captured.err  # stderr is not a terminal here


@pytest.mark.skipif(not available("cpu"), reason="the cpu backend is not available")
def test_check_quick_cpu(capsys):
    assert cli.main(["check", "--quick", "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "backend 'cpu' vs the float64 oracle" in out
    assert "(backends checked: cpu)" in out


def test_check_quick_reaches_the_decode_and_the_prefill_kernels():
    # The quick shapes are small; some must still be too many queries for the
    # CPU decode kernel, or `check --quick` would never run the prefill kernel.
    from elastic_np._contract._problem import prepare
    from elastic_np.cpu._decode import plan as _decode_plan

    decode = {}
    for case in (c for c in _cases.CASES if not c.requires & set(_cases.VARIANT_NAMES)):
        q, k, v, dout, options = _cases.draw_inputs(case, np.float32)
        decode[case.name] = _decode_plan.takes(prepare(q, k, v, **options))
    assert decode["plain"] and decode["combined"] and decode["modifiers combined"]
    assert not decode["plain, N=20"] and not decode["combined, N=20"]
    assert not decode["modifiers combined, N=20"]


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_check_named_unavailable_backend_is_an_error(name, capsys):
    if available(name):
        pytest.skip(f"the {name} backend is available here")
    assert cli.main(["check", "--quick", "--backend", name]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("elastic-np check: error: ") and repr(name) in line


def test_backend_failing_to_start_is_skipped_or_an_error(monkeypatch, capsys):
    real = elastic_np._api.dispatch.get_backend

    def failing_cuda(name):
        if name == "cuda":
            raise RuntimeError("driver missing")
        return real(name)

    monkeypatch.setattr(elastic_np._api.dispatch, "get_backend", failing_cuda)
    assert cli.main(["check", "--quick", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert ("backend 'cuda': skipped (backend 'cuda' is not available: "
            "RuntimeError: driver missing)") in out
    assert cli.main(["check", "--quick", "--backend", "cuda"]) == 2
    assert "RuntimeError: driver missing" in capsys.readouterr().err


def test_check_failure_exits_1(monkeypatch, capsys):
    honest = elastic_np.testing.backend_functions

    def broken(name):
        fn, backward = honest(name)

        def wrong_beta(q, k, v, beta=0.0, **options):
            return fn(q, k, v, beta=np.multiply(beta, 1.01), **options)

        return wrong_beta, backward

    monkeypatch.setattr(elastic_np.testing, "backend_functions", broken)
    assert cli.main(["check", "--quick", "--backend", "reference", "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAIL: ")
    assert "beta (float64)" in last and "combined (float64)" in last
    assert "plain (float64)" not in last


def test_check_subprocess():
    root = os.path.dirname(os.path.dirname(os.path.abspath(elastic_np.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-m", "elastic_np", "check", "--quick"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "float64 oracle gradients vs central differences" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: ")


# ---------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------


def test_bench_quick_json_and_plot(tmp_path, capsys):
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--quick", "--seq", "8", "16", "--heads", "1", "--dim", "4",
            "--repeat", "1", "--min-time", "0", "--json", str(json_path), "--plot", str(png_path)]
    if not has_matplotlib:
        # matplotlib is the optional `bench` extra: asking for a plot without it is a
        # one-line error before anything runs; the rest is checked without --plot.
        assert cli.main(argv) == 2
        assert "--plot needs matplotlib" in capsys.readouterr().err
        argv = argv[:-2]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "implementation" in out and "GFLOP/s" in out and "peak MiB" in out
    assert f"results written to {json_path}" in out
    assert (f"plot written to {png_path}" in out) == has_matplotlib

    data = json.loads(json_path.read_text())
    assert data["config"] == {**data["config"], "heads": 1, "dim": 4, "seqs": [8, 16],
                              "dtype": "float32", "batch": 1}
    # --quick runs every library on one thread, and says so
    assert data["config"]["threads"]["numba"] == 1
    assert "; 1 thread (kernels" in out
    assert data["matmul_peak_gflops"] > 0
    assert data["machine"]["cores"] >= 1 and data["command"].startswith("elastic-np bench")
    impls = {r["impl"] for r in data["results"]}
    assert "naive numpy" in impls
    torch_installed = importlib.util.find_spec("torch") is not None
    assert ("torch sdpa" in impls) == torch_installed
    if available("cpu"):
        assert "elastic_np cpu" in impls and "elastic_np cpu" in data["first_calls"]
    else:
        assert "elastic_np cpu" in data["unavailable"]
        assert "elastic_np cpu: unavailable" in out
    for impl in impls:
        rows = [r for r in data["results"] if r["impl"] == impl]
        assert {(r["pass"], r["seq"]) for r in rows} == {
            (p, n) for p in ("forward", "forward+backward") for n in (8, 16)}
        for r in rows:
            assert r["time_s"] > 0 and r["gflops"] > 0 and r["peak_mib"] >= 0
            assert r["fraction_of_peak"] == pytest.approx(r["gflops"] / data["matmul_peak_gflops"])
            assert f"{r['impl']:<18} {r['pass']:<16} {r['seq']:>6}" in out
    if has_matplotlib:
        assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not available("cpu"), reason="the decode benchmark times the cpu backend")
def test_bench_decode_json_and_table(tmp_path, capsys):
    json_path = tmp_path / "decode.json"
    argv = ["bench", "--decode", "--shape", "1,4,2,1,64,8", "2,4,4,3,40,8", "--rounds", "2",
            "--dtype", "float64", "--threads", "2", "--json", str(json_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "decode, float64, causal" in out and f"results written to {json_path}" in out
    data = json.loads(json_path.read_text())
    assert data["command"].startswith("elastic-np bench --decode")
    assert data["rounds"] == 2 and data["dtype"] == "float64" and data["threads"] == 2
    assert data["thread_counts"]["numba"] == 2 and "causal, 2 threads (kernels" in out
    shapes = [tuple(r["shape"].values()) for r in data["rows"]]
    assert shapes == [(1, 4, 2, 1, 64, 8), (2, 4, 4, 3, 40, 8)]
    torch_installed = importlib.util.find_spec("torch") is not None
    for row, shape in zip(data["rows"], ["1,4,2,1,64,8", "2,4,4,3,40,8"]):
        assert row["ours_ms"] > 0 and row["cache_gb_per_s"] > 0 and row["read_gb_per_s"] > 0
        ratios = [row["fraction_of_read"]] + ([row["torch_over_ours"]] if torch_installed else [])
        for r in ratios:
            assert 0 < r["min"] <= r["median"] <= r["max"]
        assert ("torch_ms" in row) == torch_installed
        assert any(line.split()[:1] == [shape] for line in out.splitlines())


def test_thread_counts_sets_every_pool_and_restores_it():
    import numba

    from elastic_np.cli import _bench

    before = numba.get_num_threads()
    with _bench.thread_counts(1) as counts:
        assert numba.get_num_threads() == 1 and counts["numba"] == 1
        if importlib.util.find_spec("torch") is not None:
            import torch

            assert torch.get_num_threads() == 1 and counts["torch"] == 1
    assert numba.get_num_threads() == before
    assert _bench.describe_threads({"numba": 2, "torch": None, "blas": 2}) == "2 threads (kernels, BLAS)"
    assert _bench.unset_notes({"numba": 2, "torch": None, "blas": 2}) == [
        "note: torch is not installed: its threads were not set and torch sdpa is not timed"]
    with pytest.raises(ValueError, match="`threads` must be an int from 1"):
        with _bench.thread_counts(0):
            pass


def test_bench_threads_is_not_a_gpu_flag(capsys):
    assert cli.main(["bench", "--gpu", "--threads", "2"]) == 2
    assert "argument --threads: not with --gpu" in capsys.readouterr().err


def test_streaming_read_reads_every_byte():
    from elastic_np.cli import _bench_decode

    for nbytes, threads, dtype in [(4 * 3_000_001, 2, np.float32), (8 * 5, 3, np.float64), (1, 1, np.float64)]:
        with _bench_decode.StreamingRead(nbytes, threads, dtype) as read:
            assert read() == max(nbytes // np.dtype(dtype).itemsize, 1)


def test_decode_benchmark_times_the_same_attention_in_torch():
    pytest.importorskip("torch")
    from elastic_np import reference
    from elastic_np.cli import _bench_decode

    for shape in [(2, 4, 2, 3, 11, 5), (1, 4, 1, 1, 7, 3)]:
        q, k, v = _bench_decode.make_inputs(shape, np.float64, seed=3)
        got = _bench_decode.torch_decode(q, k, v)().numpy()
        want, _ = reference.attention(q, k, v, causal=True)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_naive_backward_matches_reference():
    from elastic_np import reference
    from elastic_np.cli import _bench

    q, k, v = _bench.make_inputs(1, 4, 5, 7, 3, Hkv=2, dtype=np.float64)
    dout = np.random.default_rng(1).standard_normal((1, 4, 5, 3))
    out, dq, dk, dv = _bench.naive_attention_backward(q, k, v, dout, causal=True)
    ref_out, lse = reference.attention(q, k, v, causal=True)
    grads = reference.attention_backward(dout, q, k, v, ref_out, lse, causal=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    for got, want in ((dq, grads.dq), (dk, grads.dk), (dv, grads.dv)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_peak_memory_sees_a_numpy_allocation():
    from elastic_np.cli._bench import peak_memory_mib

    assert peak_memory_mib(lambda: np.ones(4 * 2**20 // 8)) >= 3.9


def test_bench_gpu_without_gpu_exits_1(tmp_path, capsys):
    from elastic_np import cuda

    if cuda.is_available():
        pytest.skip("a CUDA GPU is usable here")
    path = tmp_path / "gpu.json"
    assert cli.main(["bench", "--gpu", "--quick", "--json", str(path)]) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("elastic-np bench --gpu: ") and ("GPU" in line or "numba-cuda" in line)
    assert captured.out == "" and not path.exists()


# ---------------------------------------------------------------------------
# arguments, example, progress
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv, words", [
    (["bench", "--seq", "0"], "--seq"),
    (["bench", "--heads", "two"], "--heads"),
    (["bench", "--dtype", "float8"], "--dtype"),
    (["bench", "--gpu", "--dtype", "bfloat16"], "--dtype"),
    (["bench", "--min-time", "-1"], "--min-time"),
    (["bench", "--decode", "--shape", "1,2,3"], "--shape"),
    (["bench", "--decode", "--shape", "1,3,2,1,8,8"], "Hkv=2"),
    (["bench", "--decode", "--shape", "1,2,2,0,8,8"], "--shape"),
    (["bench", "--decode", "--seq", "8"], "--seq"),
    (["bench", "--decode", "--rounds", "0"], "--rounds"),
    (["bench", "--shape", "1,1,1,1,1,1"], "--decode"),
    (["bench", "--gpu", "--decode"], "--decode"),
    (["bench", "--gpu", "--dtype", "float64", "--precision", "tf32"], "--precision"),
    (["bench", "--gpu", "--seq", "8", "16"], "--seq"),
    (["bench", "--gpu", "--bias", "diagonal"], "--bias"),
    (["bench", "--softcap", "2"], "--gpu"),
    (["bench", "--precision", "tf32"], "--gpu"),
    (["check", "--backend", "tpu"], "--backend"),
    (["check", "--frobnicate"], "--frobnicate"),
    (["explode"], "explode"),
])
def test_bad_arguments_give_one_line_and_exit_2(argv, words, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("elastic-np") and "error:" in line and words in line


def test_no_subcommand_prints_the_example(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "softmax(x)" in out and "attention(causal, nvm, tau=0.5, beta=1)" in out


def test_progress_bar_draws_after_the_delay():
    stream = io.StringIO()
    with Progress(4, "work", stream=stream, delay=0.0) as bar:
        bar.stage("compiling (first JIT compile)")
        bar.update("a")
        bar.update("b")
    text = stream.getvalue()
    assert "compiling (first JIT compile)\n" in text
    assert "work [############............] 2/4" in text
    assert text.endswith("\n")

    quiet = io.StringIO()
    with Progress(4, "work", stream=quiet, delay=60.0) as bar:
        bar.update("a")
    assert quiet.getvalue() == ""


def test_progress_off_a_terminal_writes_a_few_plain_lines():
    stream = io.StringIO()  # a file or a pipe: isatty() is False
    with Progress(100, "work", stream=stream, delay=0.0) as bar:
        bar.stage("a notice")
        for i in range(100):
            bar.update(f"step {i}")
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "a notice" and len(lines) == 5  # the notice, then one line per quarter
    assert lines[-1].startswith("work [########################] 100/100")

    terminal = io.StringIO()
    with Progress(100, "work", stream=terminal, delay=0.0, tty=True) as bar:
        for i in range(100):
            bar.update(f"step {i}")
    assert terminal.getvalue().count("\r") == 101 and terminal.getvalue().endswith("\n")


def _wait_for(predicate, seconds=5.0):
    import time

    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


def test_a_long_step_shows_its_time_and_what_numba_compiles_on_a_terminal(monkeypatch):
    from types import SimpleNamespace

    from numba.core import event

    monkeypatch.setenv("COLUMNS", "200")  # the line is cut to the terminal's width: 80 columns would cut it here

    def my_kernel():
        pass

    stream = io.StringIO()
    bar = Progress(3, "work", stream=stream, tty=True, interval=0.01)
    bar.begin("cpu: first call of the kernels")
    bar.doing("float32 'plain', forward")
    # what Numba's dispatcher sends while it compiles (and never for a load from its cache)
    with event.trigger_event("numba:compile", data={"dispatcher": SimpleNamespace(py_func=my_kernel)}):
        assert _wait_for(lambda: "compiling " in stream.getvalue())
    assert _wait_for(lambda: "; 1 function compiled" in stream.getvalue().rsplit("\r", 1)[-1])
    bar.stage("cpu: compiled 1 function in 0.1 s")
    text = stream.getvalue()
    # (a frame may come between begin and doing, on a loaded machine: the ticker runs every 0.01 s here)
    assert text.startswith("cpu: first call of the kernels\n\r  0 s so far")
    assert "\r  0 s so far; float32 'plain', forward" in text
    assert "; float32 'plain', forward; compiling my_kernel (1 function compiled)" in text
    # the ticker's line cleared before the next message
    assert text.endswith("\r" + " " * bar.line_width + "\rcpu: compiled 1 function in 0.1 s\n")


def test_a_long_step_off_a_terminal_writes_a_line_after_each_delay_only():
    stream = io.StringIO()
    bar = Progress(3, "work", stream=stream, interval=0.01, notes_after=(0.05, 0.1))
    bar.begin("cpu: first call of the kernels")
    bar.doing("waiting for float64 in a second process")
    assert _wait_for(lambda: stream.getvalue().count("\n") == 3)
    bar.update("next")
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 3
    assert lines[1].startswith("  0 s and still running; waiting for float64 in a second process")


def test_the_first_call_line_tells_a_compile_from_a_load():
    import numba

    from elastic_np.cli import _bench

    def add_one(x):
        return x + 1

    jitted = numba.njit(cache=False, fastmath=False)(add_one)  # compiles on its first call, never cached
    impls = {"elastic_np fake": (lambda *arrays: jitted(1.0), lambda *arrays: jitted(2.0))}
    said = []
    first = _bench._first_calls(impls, [8], 4, np.dtype(np.float32), lambda *kind_message: said.append(kind_message))
    assert said[0] == ("start", "elastic_np fake: first call of the forward and backward kernels: "
                                "compiling, or loading from Numba's cache")
    assert said[1][0] == "stage" and said[1][1].startswith("elastic_np fake: compiled 1 function in ")
    assert first["elastic_np fake"]["compiled"] == 1
    said.clear()
    first = _bench._first_calls(impls, [8], 4, np.dtype(np.float32), lambda *kind_message: said.append(kind_message))
    assert said[1][1].startswith("elastic_np fake: nothing compiled (loaded from Numba's cache, or already loaded)")
    assert first["elastic_np fake"]["compiled"] == 0


@pytest.mark.parametrize("child, said", [
    (frozenset({"_forward_kernel"}), "cpu: compiled 1 function (forward_kernel) in "),
    (frozenset(), "cpu: nothing compiled (loaded from Numba's cache, or already loaded) in "),
    (None, "; the second process failed: float64 compiles on its first call in the battery"),
])
def test_check_counts_what_the_second_process_compiled(monkeypatch, child, said):
    from elastic_np.cli import _first_compile

    steps = []

    def compile_backend(name, dtypes, step=None):
        step("waiting for float64 in a second process")
        steps.append(bar.now)
        return child

    monkeypatch.setattr(_first_compile, "compile_backend", compile_backend)
    stream = io.StringIO()
    bar = Progress(1, "check", stream=stream)
    seen = cli._compile("cpu", [np.dtype(np.float32), np.dtype(np.float64)], bar)
    bar.close()
    first, second = stream.getvalue().splitlines()
    assert first == "cpu: first call of the kernels (float32, float64): compiling, or loading from Numba's cache"
    assert said in second and steps == ["waiting for float64 in a second process"]
    assert seen.compiled == (child or frozenset())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bench_takes_the_half_dtypes(dtype, tmp_path, monkeypatch, capsys):
    pytest.importorskip("ml_dtypes")
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # `import threadpoolctl` fails
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--seq", "8", "--heads", "1", "--dim", "4", "--repeat", "1",
                     "--min-time", "0", "--dtype", dtype, "--json", str(path)]) == 0
    captured = capsys.readouterr()
    data = json.loads(path.read_text())
    assert data["config"]["dtype"] == dtype and data["config"]["peak_dtype"] == "float32"
    assert data["config"]["threads"]["blas"] is None
    impls = {r["impl"] for r in data["results"]}
    assert "naive numpy" in impls and ("elastic_np cpu" in impls) == available("cpu")
    assert ("torch sdpa" in impls) == (importlib.util.find_spec("torch") is not None)
    assert all(r["time_s"] > 0 for r in data["results"])
    assert f"D=4 {dtype}; matrix-multiply peak" in captured.out
    assert "(in float32, as the kernels compute)" in captured.out
    assert ("note: NumPy's BLAS threads were not set (naive numpy ran on BLAS's own count): the optional package "
            "threadpoolctl, which sets them, is not installed (pip install threadpoolctl)") in captured.out
    assert "\r" not in captured.err


def test_torch_sdpa_takes_bfloat16_arrays():
    pytest.importorskip("torch")
    from elastic_np import reference
    from elastic_np._contract import _validation
    from elastic_np.cli import _bench

    bf16 = _validation.numpy_dtype("bfloat16")
    q, k, v = _bench.make_inputs(1, 2, 5, 5, 4, dtype=bf16)
    out = _bench.torch_sdpa(q, k, v, causal=True)
    want, _ = reference.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True)
    assert out.dtype == bf16
    np.testing.assert_allclose(out.astype(np.float64), want, atol=0.05)


@pytest.mark.skipif(not available("cpu"), reason="the decode benchmark times the cpu backend")
def test_bench_decode_takes_bfloat16(capsys):
    pytest.importorskip("ml_dtypes")
    assert cli.main(["bench", "--decode", "--shape", "1,2,1,1,16,8", "--rounds", "1", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "decode, bfloat16, causal" in out and "1,2,1,1,16,8" in out


def test_the_commands_silence_compile_warnings_only_while_they_run(monkeypatch):
    import warnings

    def compiles(args):
        warnings.warn("compiling", elastic_np.CompileWarning)
        return 0

    monkeypatch.setattr(cli, "_example", compiles)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["example"]) == 0
        assert caught == []
        compiles(None)  # outside a command, the user's filters apply
    assert [w.category for w in caught] == [elastic_np.CompileWarning]


def test_bench_at_the_default_thread_count_leaves_numbas_threading_layer_unstarted():
    # starting it loads an OpenMP runtime beside torch's, which slows torch's timings
    code = ("import numba, numba.np.ufunc.parallel as p; from elastic_np.cli import _bench\n"
            "with _bench.thread_counts(numba.config.NUMBA_NUM_THREADS): pass\n"
            "print(p._is_initialized)\n"
            "if numba.config.NUMBA_NUM_THREADS > 1:\n"
            "    with _bench.thread_counts(1): pass\n"
            "    print(p._is_initialized, numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() in (["False"], ["False", "True", "True"])  # another count sets it, and restores it
