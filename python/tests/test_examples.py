"""The Python examples and the benchmark run as a user runs them."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FASHION = os.path.join(ROOT, "python", "examples", "fashion_mnist.py")
BENCH = os.path.join(ROOT, "python", "bench", "bench.py")
DATA = "/usr/share/datasets/fashion-mnist"


def run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.skipif(not os.path.isdir(DATA), reason=f"{DATA} missing (dataset-fashion-mnist)")
def test_fashion_mnist_matches_one_process():
    results = []
    for extra in ([], ["--single"]):
        r = run(FASHION, "--workers", "2", "--epochs", "1", "--limit", "3000", *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        m = re.search(r"test loss ([0-9.]+) test accuracy ([0-9.]+)", r.stdout)
        assert m, r.stdout
        results.append((float(m.group(1)), float(m.group(2))))
    (loss, acc), (single_loss, single_acc) = results
    assert abs(loss - single_loss) < 1e-3 and abs(acc - single_acc) < 2e-3, results
    assert acc > 0.5  # it learned something in one epoch of 3000 samples


def test_fashion_mnist_missing_data_names_the_file_and_the_package(tmp_path):
    r = run(FASHION, "--data", str(tmp_path / "nowhere"))
    assert r.returncode != 0
    assert "nowhere/train-images-idx3-ubyte.gz not found" in r.stderr
    assert "dataset-fashion-mnist" in r.stderr
    assert "Traceback" not in r.stderr


def bench_header(stdout):
    """bench.py's lines before its table: {'machine': ..., 'blas': ..., 'optimizer': ...}."""
    lines = stdout.split("\n| model |", 1)[0].splitlines()
    return dict(line.split(": ", 1) for line in lines)


def test_bench_short_run_writes_a_row_per_model_and_mode(tmp_path):
    """An MLP and a real model (BatchNorm, Dropout) at one step in single, gradagg and ddp, in
    two rounds (each model's modes twice in turn, one row per mode); single-kept: below."""
    out = tmp_path / "bench.jsonl"
    r = run(BENCH, "-m", "807,cnn", "--modes", "single,gradagg,ddp", "--steps", "2",
            "--warmup", "1", "--rounds", "2", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["model"], row["mode"]) for row in rows] == [
        (model, mode) for model in ("784-1-1-10", "cnn") for mode in ("single", "gradagg", "ddp")]
    assert {row["model"]: row["params"] for row in rows} == {"784-1-1-10": 807, "cnn": 421834}
    assert {row["model"]: row["batch"] for row in rows} == {"784-1-1-10": 16, "cnn": 64}
    assert all(row["steps"] == 2 and row["rounds"] == 2 and row["ms_per_step"] > 0
               and row["round_min_ms"] <= row["ms_per_step"] <= row["round_max_ms"]
               and row["speedup_vs_single_kept"] is None  # not among the modes
               for row in rows), rows
    assert rows[0]["speedup_vs_single"] == 1.0
    # The header names the optimizer and the BLAS, and every row says the same.
    header = bench_header(r.stdout)
    assert header["optimizer"] == "sgd, lr 0.01", r.stdout
    blas = rows[0]["blas"]
    assert set(blas) == {"library", "vendor", "threading", "threads", "config"}, blas
    assert blas["vendor"] in {"openblas", "mkl", "blis", "reference", "unknown"}, blas
    assert blas["threading"] in {"openmp", "pthreads", "sequential", "unknown"}, blas
    assert header["blas"].startswith(f"{blas['vendor']} ({blas['threading']}"), r.stdout
    assert header["blas"].endswith(blas["library"]), r.stdout
    assert all(row["optimizer"] == "sgd" and row["blas"] == blas for row in rows), rows
    # Each round's own ms go to stderr, mode by mode, with the ratio against its single.
    rounds = [line for line in r.stderr.splitlines() if " round " in line]
    assert len(rounds) == 4, r.stderr
    assert re.match(r"\s+cnn round 2/2: single [0-9.e+]+, gradagg [0-9.e+]+ \([0-9.e+]+x\), "
                    r"ddp [0-9.e+]+ \([0-9.e+]+x\) ms$", rounds[-1]), rounds


def test_bench_kept_heap_mode_and_optimizer_option(tmp_path):
    """single-kept (one process with gradagg's worker heap) beside single, every mode with
    --optimizer adam: each row says adam, and gradagg's and DDP's have a ratio against both
    single modes. The smallest model, two rounds of one step."""
    modes = ("single", "single-kept", "gradagg", "ddp")
    out = tmp_path / "bench.jsonl"
    r = run(BENCH, "-m", "807", "--modes", ",".join(modes), "--optimizer", "adam",
            "--steps", "2", "--warmup", "1", "--rounds", "2", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {row["mode"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == list(modes)
    assert all(row["optimizer"] == "adam" and row["speedup_vs_single"] > 0
               for row in rows.values()), rows
    assert rows["single"]["speedup_vs_single"] == 1.0
    # Against the kept heap: the rows that split the batch, not the references themselves.
    assert [mode for mode, row in rows.items() if row["speedup_vs_single_kept"]] == [
        "gradagg", "ddp"], rows
    assert all(rows[mode]["speedup_vs_single_kept"] > 0 for mode in ("gradagg", "ddp")), rows
    assert rows["single"]["threads"] == rows["single-kept"]["threads"] == os.cpu_count()
    assert bench_header(r.stdout)["optimizer"] == "adam, lr 0.01", r.stdout
    assert re.search(r"^\| 784-1-1-10 \| 807 \| 16 \| single-kept \| 1 x ", r.stdout, re.M)
    rounds = [line for line in r.stderr.splitlines() if " round " in line]
    ms, x = r"[0-9.e+]+", r"[0-9.e+]+x"
    assert re.match(rf"\s+807 round 2/2: single {ms}, single-kept {ms} \({x}\), "
                    rf"gradagg {ms} \({x}, {x} vs kept heap\), "
                    rf"ddp {ms} \({x}, {x} vs kept heap\) ms$", rounds[-1]), rounds
    bad = run(BENCH, "--optimizer", "rmsprop")
    assert bad.returncode == 2 and "invalid choice: 'rmsprop'" in bad.stderr, bad.stderr
