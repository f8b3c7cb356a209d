"""Test models and the independent single-process reference (plain autograd)."""
import copy

import torch


def mlp(dtype=torch.float32, seed=7, batchnorm=False, dropout=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(5, 8)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(8))
    layers.append(torch.nn.Tanh())
    if dropout:
        layers.append(torch.nn.Dropout(0.5))
    layers.append(torch.nn.Linear(8, 3))
    return torch.nn.Sequential(*layers).to(dtype)


def data(batch=24, dtype=torch.float32, seed=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 5, generator=g, dtype=dtype)
    y = torch.randn(batch, 3, generator=g, dtype=dtype)
    return x, y


def bounds(batch, workers, unequal):
    """Row boundaries of the shards: equal as far as possible, or 1, 2, 3... parts."""
    if not unequal:
        return [batch * r // workers for r in range(workers + 1)]
    parts = list(range(1, workers + 1))
    total = sum(parts)
    out = [0]
    for p in parts[:-1]:
        out.append(out[-1] + batch * p // total)
    out.append(batch)
    return out


def shard_fn(model, x, y, b):
    def shard(ctx):
        lo, hi = b[ctx.rank], b[ctx.rank + 1]
        return torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]), hi - lo
    return shard


def full_batch_grads(model, x, y):
    """The gradient of the whole batch's loss, by autograd on a copy of the model."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]
