"""Sparse gradients: Embedding(sparse=True) and EmbeddingBag(sparse=True) give the
parent a sparse, coalesced .grad equal to one process's after coalesce(), so
torch.optim.SparseAdam (and SGD) train as in one process."""
import torch

import gradagg


class Bag(torch.nn.Module):
    """An embedding (or embedding bag) through ReLU and a linear head. Row 3 starts
    all negative: touched, its gradient is exactly zero (and still listed)."""

    def __init__(self, bag):
        super().__init__()
        torch.manual_seed(5)
        self.bag = bag
        self.emb = (torch.nn.EmbeddingBag(12, 4, mode="mean", sparse=True) if bag
                    else torch.nn.Embedding(12, 4, sparse=True))
        self.head = torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.emb.weight[3].fill_(-1.0)

    def loss(self, ids, y):
        h = self.emb(ids) if self.bag else self.emb(ids).mean(1)
        return torch.nn.functional.mse_loss(self.head(torch.relu(h)).squeeze(1), y)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 10, (9, 3), generator=g), torch.randn(9, generator=g)


def shard(model):
    def run(ctx):
        ids, y = ctx.message["ids"], ctx.message["y"]
        rows = slice(3 * ctx.rank, 3 * ctx.rank + 3)
        return model.loss(ids[rows], y[rows]), 3
    return run


def test_the_grad_is_sparse_coalesced_and_one_processs_after_coalesce():
    for bag in (False, True):
        one, model = Bag(bag), Bag(bag)
        ids, y = batch(0)
        one.loss(ids, y).backward()
        want = one.emb.weight.grad.coalesce()
        with gradagg.Aggregator(model, shard(model), workers=3) as agg:
            agg.step({"ids": ids, "y": y})
        got = model.emb.weight.grad
        assert got.is_sparse and got.is_coalesced(), bag
        assert torch.equal(got.indices(), want.indices()), (bag, got.indices(), want.indices())
        assert torch.allclose(got.values(), want.values(), rtol=1e-5, atol=1e-7), bag
        assert not model.head.weight.grad.is_sparse


def test_sparse_adam_trains_as_one_process():
    one, model = Bag(False), Bag(False)
    opts_one = [torch.optim.SparseAdam([one.emb.weight], lr=0.05),
                torch.optim.Adam(one.head.parameters(), lr=0.05)]
    opts = [torch.optim.SparseAdam([model.emb.weight], lr=0.05),
            torch.optim.Adam(model.head.parameters(), lr=0.05)]
    with gradagg.Aggregator(model, shard(model), workers=3) as agg:
        for step in range(8):
            ids, y = batch(step)
            for o in opts_one:
                o.zero_grad()
            one.loss(ids, y).backward()
            for o in opts_one:
                o.step()
            for o in opts:
                o.zero_grad()
            agg.step({"ids": ids, "y": y})
            for o in opts:
                o.step()
    for (name, a), b in zip(model.named_parameters(), one.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
    # Rows 10 and 11 were never looked up: SparseAdam never touched them.
    assert torch.equal(model.emb.weight[10:], one.emb.weight[10:])
