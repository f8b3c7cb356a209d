"""gradagg against PyTorch's own DistributedDataParallel (Gloo, two processes):
the same model, data and shards give the same averaged gradient, and the same
parameters after a few SGD steps."""
import os
import subprocess
import sys
import textwrap

import torch

import gradagg
from models import data, mlp

DDP_RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from models import data, mlp
    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    x, y = data(24)
    x, y = x[12 * rank:12 * (rank + 1)], y[12 * rank:12 * (rank + 1)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    if rank == 0:
        torch.save({{"grads": grads, "params": [p.detach().clone() for p in model.parameters()]}},
                   out)
    dist.destroy_process_group()
""")


def test_same_gradients_and_parameters_as_ddp(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = DDP_RANK.format(tests=tests)
    out = tmp_path / "ddp.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(tmp_path / "init"),
                               str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, o + e
    ddp = torch.load(out)

    model = mlp()
    x, y = data(24)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def shard(ctx):
        lo, hi = 12 * ctx.rank, 12 * (ctx.rank + 1)
        return torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]), hi - lo

    with gradagg.Aggregator(model, shard, workers=2, weighting="equal") as agg:
        for step in range(3):
            agg.step()
            for p, g in zip(model.parameters(), ddp["grads"][step]):
                torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
            opt.step()
    for p, q in zip(model.parameters(), ddp["params"]):
        torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)
