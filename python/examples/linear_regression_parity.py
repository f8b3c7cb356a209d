#!/usr/bin/env python3
"""The parity demo in Python: y = theta * x + bias fitted to y = 3x + 4 on four
points, once by gradagg workers (each owning part of the batch) and once in this
process on the full batch. Exits non-zero unless the two predictions at x = 1
agree within 1e-6 relative. Same model, data and split as the C++ demo
(examples/linear_regression_parity.cpp): the float32 bits it prints are the same.

    PYTHONPATH=build/python python3 python/examples/linear_regression_parity.py --workers 4
"""
import argparse
import sys

import torch

import gradagg


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.ones(1))
        self.bias = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.theta * x + self.bias


def bits(t):
    return t.detach().view(torch.int32).item() & 0xFFFFFFFF


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-w", "--workers", type=int, default=4, choices=range(1, 5),
                        metavar="1..4", help="worker processes (default 4)")
    parser.add_argument("-s", "--steps", type=int, default=100, help="SGD steps (default 100)")
    args = parser.parse_args()

    x = torch.tensor([2.0, 4.0, 6.0, 10.0])
    y = 3 * x + 4
    lr = 0.01

    single = Linear()
    single_opt = torch.optim.SGD(single.parameters(), lr=lr)
    for _ in range(args.steps):
        single_opt.zero_grad()
        torch.nn.functional.mse_loss(single(x), y).backward()
        single_opt.step()

    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def shard(ctx):  # worker g of G owns samples [4g/G, 4(g+1)/G)
        n = x.size(0)
        begin = n * ctx.global_rank // ctx.global_workers
        end = n * (ctx.global_rank + 1) // ctx.global_workers
        return torch.nn.functional.mse_loss(model(x[begin:end]), y[begin:end]), end - begin

    total_ms = 0.0
    with gradagg.Aggregator(model, shard, workers=args.workers) as agg:
        for _ in range(args.steps):
            total_ms += agg.step().total_ms
            opt.step()

    with torch.no_grad():
        one = torch.ones(1)
        p_single = single(one).item()
        p_agg = model(one).item()
    diff = abs(p_single - p_agg)
    rel = diff / max(abs(p_single), 1e-30)
    print(f"prediction at x = 1 after {args.steps} steps (SGD lr {lr}):")
    print(f"  single process      : {p_single:.12f}")
    print(f"  gradagg, {args.workers} workers  : {p_agg:.12f}")
    print(f"  absolute difference : {diff:.3e} (relative {rel:.3e})")
    print("  true value          : 7")
    print(f"  theta {model.theta.item():.9f} bias {model.bias.item():.9f}; "
          f"gradagg steps took {total_ms:.1f} ms in all")
    print(f"  float32 bits        : theta {bits(model.theta):#010x} bias {bits(model.bias):#010x}")
    if not rel <= 1e-6:
        print("FAIL: the two trainings differ by more than 1e-6 relative", file=sys.stderr)
        return 1
    print("OK: they agree within 1e-6 relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
