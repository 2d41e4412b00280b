"""The CUDA benchmark's results file and its command line, as far as they run without a GPU."""

import json

import numpy as np
import pytest

pytest.importorskip("numba_cuda", reason="needs the cuda extra (numba-cuda)")

from elastic_np import cuda
from elastic_np.cli import _cuda, _cuda_bench

SHAPE = (4, 16, 4096, 64)
DECODE = (1, 32, 8, 1, 8192, 128)


def fake_timings(ours, theirs):
    return {
        "elastic_np": {"forward": ours, "forward+backward": 3 * ours},
        "torch": {"forward": theirs, "forward+backward": 2 * theirs},
        "tflops": {"elastic_np": {"forward": 10.0, "forward+backward": 8.0},
                   "torch": {"forward": 20.0, "forward+backward": 25.0}},
    }


def test_results_file_round_trip(tmp_path):
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "13.0", "numba_cuda": "0.30.4"}
    options = {"causal": True, "softcap": None, "alibi": False, "bias": None}
    decode = [(DECODE, {"elastic_np": 4e-4, "torch": 1e-4})]
    record = _cuda_bench.bench_record(SHAPE, options, fake_timings(0.02, 0.01), decode, machine, command="cmd")
    path = tmp_path / "h100.json"
    _cuda_bench.write_json(record, path)
    back = json.loads(path.read_text())
    assert back["kind"] == "cuda" and back["dtype"] == "float32" and back["command"] == "cmd"
    assert back["machine"] == machine
    assert back["config"] == {"B": 4, "H": 16, "N": 4096, "M": 4096, "D": 64, **options}
    assert back["results"]["elastic_np"]["forward"] == {"seconds": 0.02, "tflops": 10.0}
    assert back["results"]["torch"]["forward+backward"] == {"seconds": 0.02, "tflops": 25.0}
    assert back["speed_ratio"] == pytest.approx({"forward": 0.5, "forward+backward": 1 / 3})
    (entry,) = back["decode"]
    assert entry["shape"] == {"B": 1, "H": 32, "Hkv": 8, "N": 1, "M": 8192, "D": 128}
    assert entry["seconds"] == {"elastic_np": 4e-4, "torch": 1e-4}
    assert entry["speed_ratio"] == pytest.approx(0.25)


def test_decode_entry_splits_a_call_into_kernels_and_host():
    machine = {"gpu": "NVIDIA H200", "copy_bandwidth": 4.0e12}
    timings = {"elastic_np": 4e-4, "torch": 1e-4, "elastic_np kernels": 1e-4}
    record = _cuda_bench.bench_record(SHAPE, {}, fake_timings(0.02, 0.01), [(DECODE, timings)], machine, command="c")
    (entry,) = record["decode"]
    kv_bytes = 2 * 8 * 8192 * 128 * 4
    assert entry["host_seconds"] == pytest.approx(3e-4)
    assert entry["kv_read_bandwidth"] == pytest.approx(kv_bytes / 1e-4)
    assert entry["copy_fraction"] == pytest.approx(kv_bytes / 1e-4 / 4.0e12)
    table = _cuda_bench.format_table(record)
    assert "kernels 0.100 ms (K/V read at 671 GB/s, 17% of a device copy's rate), host 0.300 ms" in table
    assert "device-to-device copy 4000 GB/s" in _cuda_bench.machine_line(machine)


def test_decode_shapes_include_the_issue_shape():
    assert DECODE in _cuda_bench.DECODE_SHAPES


@pytest.mark.skipif(cuda.is_available(), reason="a CUDA GPU is usable here")
def test_bench_json_without_gpu_exits_with_a_clear_message(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "out.json"
    with pytest.raises(SystemExit) as info:
        _cuda.main(["--bench", "--json", str(path)])
    message = str(info.value.code)
    assert message.startswith("python -m elastic_np.cuda --bench:") and "GPU" in message
    assert not path.exists()


@pytest.mark.skipif(cuda.is_available(), reason="a CUDA GPU is usable here")
def test_bench_decode_without_gpu_raises_clear_error():
    import elastic_np as enp

    with pytest.raises(enp.BackendUnavailableError, match="GPU"):
        _cuda_bench.bench_decode(1, 2, 1, 1, 16, 8)


def test_json_needs_bench(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _cuda.main(["--json", str(tmp_path / "x.json")])
    assert info.value.code == 2 and "--json needs --bench" in capsys.readouterr().err


def test_both_command_lines_run_one_benchmark(monkeypatch):
    from elastic_np import cli

    calls = []
    monkeypatch.setattr(_cuda_bench, "run", lambda shape, **options: calls.append((tuple(shape), options)))
    _cuda.main(["--bench", "--shape", "2", "4", "256", "32", "--causal", "--bias", "keys", "--json", "x.json"])
    argv = ["bench", "--gpu", "--batch", "2", "--heads", "4", "--seq", "256", "--dim", "32", "--causal",
            "--bias", "keys", "--json", "x.json"]
    assert cli.main(argv) == 0
    (shape, options), (gpu_shape, gpu_options) = calls
    assert shape == gpu_shape == (2, 4, 256, 32)
    assert gpu_options.pop("command") == "elastic-np " + " ".join(argv) and gpu_options.pop("repeat") is None
    want = {"causal": True, "softcap": None, "alibi": False, "bias": "keys", "json_path": "x.json",
            "dtype": "float32", "precision": None}
    assert options == gpu_options == want


def test_run_prints_the_table_and_writes_the_results_file(monkeypatch, tmp_path, capsys):
    """`run` end to end with the timing functions replaced: the file `bench_record` makes, the table of it."""
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "13.0", "numba_cuda": "0.30.4"}
    monkeypatch.setattr(_cuda_bench, "bench", lambda B, H, N, D, **options: fake_timings(0.02, 0.01))
    monkeypatch.setattr(_cuda_bench, "bench_decode", lambda *shape: {"elastic_np": 4e-4, "torch": 1e-4})
    monkeypatch.setattr(_cuda_bench, "machine_info", lambda: machine)
    monkeypatch.setattr(_cuda_bench, "copy_bandwidth", lambda: 3.0e12)
    path = tmp_path / "h100.json"
    result = _cuda_bench.run(SHAPE, causal=True, json_path=str(path), command="cmd")
    assert result == fake_timings(0.02, 0.01)
    record = json.loads(path.read_text())
    options = {"causal": True, "softcap": None, "alibi": False, "bias": None}
    runs = [(dict(config), fake_timings(0.02, 0.01)) for config in _cuda_bench.RECORD_RUNS]
    want = _cuda_bench.bench_record(SHAPE, options, result, [(s, {"elastic_np": 4e-4, "torch": 1e-4})
                                                              for s in _cuda_bench.DECODE_SHAPES],
                                    {**machine, "copy_bandwidth": 3.0e12}, command="cmd", runs=runs)
    assert record == json.loads(json.dumps(want))
    assert [run["config"] for run in record["runs"]] == [dict(c) for c in _cuda_bench.RECORD_RUNS]
    assert "float64, precision=None" in _cuda_bench.format_table(record)
    printed = capsys.readouterr().out
    assert _cuda_bench.format_table(record) in printed and "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in printed
    assert f"wrote {path}" in printed
    _cuda_bench.run(SHAPE)  # without --json: no decode shapes, nothing written
    printed = capsys.readouterr().out
    assert "decoding" not in printed and "wrote" not in printed and "0.50" in printed
    _cuda_bench.run(SHAPE, precision="tf32")  # the table's first line says what ran
    assert "float32, precision=tf32, B=4 H=16" in capsys.readouterr().out


# `bench`'s parts that run without a GPU (`_ours`, which needs the kernels, runs in test_sim_bench.py)


@pytest.mark.parametrize("bias", [None, *sorted(_cuda_bench.BENCH_BIAS_SHAPES)])
def test_bench_arrays_are_seeded_float32(bias):
    from elastic_np.cli import _bench

    q, k, v, dout, bias_array = _cuda_bench._bench_arrays(2, 3, 8, 4, bias)
    for got, want in zip((q, k, v), _bench.make_inputs(2, 3, 8, 8, 4, dtype=np.float32)):
        np.testing.assert_array_equal(got, want)
    assert dout.shape == q.shape and dout.dtype == np.float32
    if bias is None:
        assert bias_array is None
    else:
        assert bias_array.shape == _cuda_bench.BENCH_BIAS_SHAPES[bias](2, 3, 8) and bias_array.dtype == np.float32
    again = _cuda_bench._bench_arrays(2, 3, 8, 4, bias)
    for got, want in zip((dout, bias_array), again[3:]):
        np.testing.assert_array_equal(got, want)


def test_bench_modifiers():
    assert _cuda_bench._modifiers(4, None, False, None) == {}
    bias = object()
    got = _cuda_bench._modifiers(4, 30.0, True, bias)
    assert got["softcap"] == 30.0 and got["bias"] is bias
    np.testing.assert_allclose(got["alibi_slopes"], [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])


def test_time_runs_warms_up_once_then_takes_the_best_of_repeat():
    calls = {}

    def counted(name):
        calls[name] = 0

        def fn():
            calls[name] += 1

        return fn

    runs = {"a": (counted("a fwd"), counted("a both")), "b": (counted("b fwd"), counted("b both"))}
    timings = _cuda_bench._time_runs(runs, repeat=3)
    assert set(timings) == {"a", "b"} and all(set(t) == {"forward", "forward+backward"} for t in timings.values())
    assert all(0 <= s < 1 for t in timings.values() for s in t.values())
    assert calls == {"a fwd": 4, "a both": 4, "b fwd": 4, "b both": 4}


def test_tflops_follow_the_flop_convention():
    from elastic_np.cli import _bench

    timings = {"x": {"forward": 0.5, "forward+backward": 2.0}}
    got = _cuda_bench._tflops(timings, (1, 2, 64, 16), True)
    assert got["x"]["forward"] == _bench.attention_flops(1, 2, 64, 64, 16, causal=True) / 0.5 / 1e12
    assert got["x"]["forward+backward"] == (
        _bench.attention_flops(1, 2, 64, 64, 16, causal=True, backward=True) / 2.0 / 1e12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [None, "keys"])
def test_torch_runs_on_cpu_tensors(monkeypatch, causal, bias):
    torch = pytest.importorskip("torch")
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(1))
    arrays = _cuda_bench._bench_arrays(1, 2, 8, 4, bias)
    tensors = tuple(None if a is None else torch.from_numpy(a) for a in arrays)
    forward, forward_backward = _cuda_bench._torch_runs(torch, tensors, causal)
    forward()
    forward_backward()
    assert len(synced) == 2
    assert all(t.grad is None for t in tensors if t is not None)  # the backward's inputs are copies


def test_dtype_and_precision_reach_the_benchmark(monkeypatch):
    from elastic_np import cli

    calls = []
    monkeypatch.setattr(_cuda_bench, "run", lambda shape, **options: calls.append(options))
    _cuda.main(["--bench", "--dtype", "float64"])
    _cuda.main(["--bench", "--precision", "tf32"])
    assert cli.main(["bench", "--gpu", "--precision", "tf32"]) == 0
    assert cli.main(["bench", "--gpu", "--dtype", "float64"]) == 0
    assert [{k: o[k] for k in ("dtype", "precision")} for o in calls] == [
        {"dtype": "float64", "precision": None}, {"dtype": "float32", "precision": "tf32"},
        {"dtype": "float32", "precision": "tf32"}, {"dtype": "float64", "precision": None}]
    assert cli.main(["bench", "--gpu", "--dtype", "float64", "--precision", "tf32"]) == 2
