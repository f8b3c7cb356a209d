"""The BLAS LibTorch's gemm runs on, as gradagg.blas_info() names it; the
threads a worker and the parent get; the one warning on the reference BLAS."""
import os
import subprocess
import sys

import pytest
import torch

import gradagg
from models import bounds, data, full_batch_grads, mlp, shard_fn

LIB = "/usr/lib/x86_64-linux-gnu"


def test_blas_info_names_a_library_this_process_maps():
    info = gradagg.blas_info()
    assert info.library, str(info)
    with open("/proc/self/maps") as maps:
        assert info.library in maps.read(), str(info)
    assert info.vendor in ("openblas", "mkl", "blis", "reference"), str(info)
    assert info.threading in ("openmp", "pthreads", "sequential"), str(info)
    assert info.threads >= 1
    assert info.to_dict()["library"] == info.library
    assert str(info).startswith(info.vendor + " (" + info.threading)
    assert info.fast == (info.vendor != "reference")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_workers_blas_threads_are_its_placed_count(threads):
    model = mlp()
    x, y = data(12)
    inner = shard_fn(model, x, y, bounds(12, 2, False))

    def shard(ctx):
        a = torch.randn(384, 384)
        (a @ a).sum()  # the pool as it is after a gemm
        info = gradagg.blas_info()
        if info.fast and info.threads != threads:
            raise RuntimeError(f"BLAS threads {info.threads}, placed {threads}: {info}")
        if torch.get_num_threads() != threads:
            raise RuntimeError(f"intra-op threads {torch.get_num_threads()}")
        return inner(ctx)

    want = full_batch_grads(model, x, y)
    with gradagg.Aggregator(model, shard, workers=2, threads_per_worker=threads) as agg:
        agg.step()
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)


def test_the_parent_gets_its_threads_back_after_close():
    torch.set_num_threads(2)
    gradagg.set_blas_threads(2)
    model = mlp()
    x, y = data(8)
    agg = gradagg.Aggregator(model, shard_fn(model, x, y, bounds(8, 2, False)), workers=2)
    agg.step()
    assert torch.get_num_threads() == 1  # parent_threads=1: the workers' cores stay theirs
    agg.close()
    assert torch.get_num_threads() == 2
    assert gradagg.blas_info().threads == 2 or not gradagg.blas_info().fast
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(8, 2, False)), workers=2,
                            parent_threads=-1) as agg:
        agg.step()
        assert torch.get_num_threads() == os.sched_getaffinity(0).__len__()
    torch.set_num_threads(1)


SCRIPT = """
import torch, gradagg
m = torch.nn.Linear(2, 1)
x = torch.randn(4, 2)
def shard(ctx):
    return torch.nn.functional.mse_loss(m(x), torch.zeros(4, 1)), 4
for _ in range(2):
    with gradagg.Aggregator(m, shard, workers=2) as agg:
        agg.step()
print(gradagg.blas_info().vendor)
"""
WARNING = "gradagg: warning: LibTorch's matrix products run on the reference BLAS"


@pytest.mark.skipif(not os.path.exists(f"{LIB}/blas/libblas.so.3"),
                    reason="the reference BLAS (libblas3) is not installed")
def test_the_reference_blas_gets_one_warning_naming_the_package():
    env = dict(os.environ, LD_LIBRARY_PATH=f"{LIB}/blas:{LIB}/lapack")
    env.pop("GRADAGG_QUIET_BLAS", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "reference"
    lines = [l for l in run.stderr.splitlines() if WARNING in l]
    assert len(lines) == 1, run.stderr
    assert "apt-get install libopenblas0-openmp" in lines[0]


def test_a_fast_blas_gets_no_warning():
    if not gradagg.blas_info().fast:
        pytest.skip("this process runs on the reference BLAS")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert WARNING not in run.stderr
