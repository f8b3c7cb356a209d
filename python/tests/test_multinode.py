"""Two nodes (two Python processes on this machine, a c10d FileStore between
them) train the same model as one process on the whole batch."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

NODE = textwrap.dedent("""
    import sys, torch, gradagg
    sys.path.insert(0, {tests!r})
    from models import data, mlp
    rank, store, out, bucket_bytes = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    model = mlp()
    x, y = data(24)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def shard(ctx):   # global worker g of G owns rows [24g/G, 24(g+1)/G)
        lo = 24 * ctx.global_rank // ctx.global_workers
        hi = 24 * (ctx.global_rank + 1) // ctx.global_workers
        return torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]), hi - lo
    nodes = gradagg.NodeOptions(nodes=2, node_rank=rank, store_path=store, timeout=60)
    if bucket_bytes:  # every parameter a bucket of its own, crossing during backward
        nodes.bucket_bytes = nodes.first_bucket_bytes = bucket_bytes
    with gradagg.Aggregator(model, shard, workers=1, nodes=nodes) as agg:
        for _ in range(4):
            report = agg.step()
            opt.step()
    assert report.samples == 24, report.samples
    assert (report.node_collectives > 2) == bool(bucket_bytes), report.node_collectives
    torch.save([p.detach().clone() for p in model.parameters()], out)
""")


@pytest.mark.parametrize("bucket_bytes", [0, 16], ids=["one-collective", "buckets"])
def test_two_nodes_match_one_process(tmp_path, bucket_bytes):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = NODE.format(tests=tests)
    store = str(tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), store,
                               str(tmp_path / f"node{r}.pt"), str(bucket_bytes)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, out + err

    sys.path.insert(0, tests)
    from models import data, mlp
    single = mlp()
    x, y = data(24)
    opt = torch.optim.SGD(single.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(single(x), y).backward()
        opt.step()
    nodes = [torch.load(tmp_path / f"node{r}.pt") for r in range(2)]
    for a, b, want in zip(nodes[0], nodes[1], single.parameters()):
        assert torch.equal(a, b)  # the nodes agree bit for bit
        torch.testing.assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)


DISAGREE = textwrap.dedent("""
    import sys, torch, gradagg
    rank, store, seed = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)  # the same torch seed: must_match is what differs
    model = torch.nn.Linear(2, 1)
    nodes = gradagg.NodeOptions(nodes=2, node_rank=rank, store_path=store, timeout=30,
                                must_match={"seed": seed})
    try:
        gradagg.Aggregator(model, lambda ctx: (model.weight.sum(), 1), workers=1, nodes=nodes)
    except gradagg.InvalidArgument as e:
        print("refused:", e)
        sys.exit(3)
""")


def test_nodes_with_different_settings_are_refused_on_every_node(tmp_path):
    store = str(tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-c", DISAGREE, str(r), store, str(r + 1)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 3, out + err
            assert "must_match[seed]" in out and "node 0: 1, node 1: 2" in out, out + err
    finally:
        for p in procs:
            p.kill()
            p.wait()
