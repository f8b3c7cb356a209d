#!/usr/bin/env python3
"""Fashion-MNIST in Python: a 784-64-10 classifier trained with Adam by gradagg
workers (the parameter-server pattern: workers compute gradients on their
shards, the parent averages them and steps Adam), or in one process (--single)
on the same global batches.

    PYTHONPATH=build/python python3 python/examples/fashion_mnist.py --workers 2 --epochs 5

Data: Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist), or --data DIR
with the four IDX .gz files.
"""
import argparse
import gzip
import os
import sys
import threading
import time

import numpy as np
import torch

import gradagg

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path, magic, dims):
    """The IDX file at `path` as a uint8 tensor; clear errors for a missing or bad file."""
    if not os.path.exists(path):
        raise SystemExit(f"fashion_mnist: {path} not found (install Debian's "
                         f"dataset-fashion-mnist, or pass --data DIR)")
    with gzip.open(path, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw[:4 + 4 * dims], dtype=">u4")
    if len(header) != 1 + dims or header[0] != magic:
        raise SystemExit(f"fashion_mnist: {path} is not an IDX file of {dims} dimensions")
    shape = [int(v) for v in header[1:]]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if data.size != int(np.prod(shape)):
        raise SystemExit(f"fashion_mnist: {path} is truncated")
    return torch.from_numpy(data.copy()).reshape(shape)


def load(data_dir, split):
    images = read_idx(os.path.join(data_dir, f"{split}-images-idx3-ubyte.gz"), 0x803, 3)
    labels = read_idx(os.path.join(data_dir, f"{split}-labels-idx1-ubyte.gz"), 0x801, 1)
    return images.reshape(len(images), -1).float().div_(255.0), labels.long()


def make_model(hidden, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


class Progress:
    """A tqdm-style progress line, redrawn by a monitor thread (as tqdm's is)
    while training runs; plain lines when stdout is not a terminal."""

    def __init__(self, total, desc):
        self.total, self.desc, self.done, self.loss = total, desc, 0, float("nan")
        self.begin = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._monitor, daemon=True)
        self.thread.start()

    def update(self, steps, loss):
        self.done += steps
        self.loss = loss

    def line(self):
        elapsed = time.monotonic() - self.begin
        rate = self.done / elapsed if elapsed > 0 else 0
        eta = (self.total - self.done) / rate if rate > 0 else 0
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        return (f"{self.desc} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"steps, loss {self.loss:.4f}, {rate:.0f} steps/s, ETA {eta:.0f}s")

    def _monitor(self):
        interval = 0.2 if self.tty else 5.0
        while not self.stop.wait(interval):
            if self.tty:
                print("\r" + self.line(), end="", flush=True)
            else:
                print(self.line(), flush=True)

    def close(self):
        self.stop.set()
        self.thread.join()
        if self.tty:
            print("\r" + self.line(), flush=True)


def evaluate(model, x, y):
    with torch.no_grad():
        out = model(x)
        return (torch.nn.functional.cross_entropy(out, y).item(),
                (out.argmax(1) == y).float().mean().item())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEBIAN_DIR, help=f"IDX folder (default {DEBIAN_DIR})")
    p.add_argument("-w", "--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("-e", "--epochs", type=int, default=5)
    p.add_argument("-b", "--batch", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=1, help="initial weights and data order")
    p.add_argument("--limit", type=int, default=0, help="the first N training samples (0: all)")
    p.add_argument("--single", action="store_true",
                   help="one process on the same global batches (batch x workers)")
    args = p.parse_args()
    if args.workers < 1 or args.batch < 1 or args.epochs < 0:
        p.error("--workers, --batch must be >= 1 and --epochs >= 0")

    train_x, train_y = load(args.data, "train")
    test_x, test_y = load(args.data, "t10k")
    if args.limit:
        train_x, train_y = train_x[:args.limit], train_y[:args.limit]
    global_batch = args.batch * args.workers
    steps_per_epoch = len(train_x) // global_batch
    if steps_per_epoch == 0:
        p.error(f"fewer training samples ({len(train_x)}) than one global batch ({global_batch})")

    model = make_model(args.hidden, args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    orders = {}

    def order(epoch):  # the epoch's sample order: the same in the parent and every worker
        if epoch not in orders:
            g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
            orders.clear()
            orders[epoch] = torch.randperm(len(train_x), generator=g)
        return orders[epoch]

    def rows(step, lo, hi):
        epoch, i = divmod(step, steps_per_epoch)
        return order(epoch)[i * global_batch + lo:i * global_batch + hi]

    def shard(ctx):  # worker r's args.batch samples of the step's global batch
        idx = rows(ctx.step, ctx.rank * args.batch, (ctx.rank + 1) * args.batch)
        return torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx]), len(idx)

    mode = "one process" if args.single else f"gradagg, {args.workers} workers"
    print(f"Fashion-MNIST: {len(train_x)} training samples, {mode}, global batch "
          f"{global_batch}, {steps_per_epoch} steps per epoch, Adam {args.lr}")
    agg = None if args.single else gradagg.Aggregator(model, shard, workers=args.workers)
    try:
        for epoch in range(args.epochs):
            progress = Progress(steps_per_epoch, f"epoch {epoch + 1}/{args.epochs}")
            begin = time.monotonic()
            total_loss = 0.0
            try:
                for i in range(steps_per_epoch):
                    step = epoch * steps_per_epoch + i
                    if agg is not None:
                        loss = agg.step().loss
                    else:
                        opt.zero_grad()
                        idx = rows(step, 0, global_batch)
                        loss_t = torch.nn.functional.cross_entropy(model(train_x[idx]),
                                                                   train_y[idx])
                        loss_t.backward()
                        loss = loss_t.item()
                    opt.step()
                    total_loss += loss
                    progress.update(1, loss)
            finally:
                progress.close()
            seconds = time.monotonic() - begin
            test_loss, accuracy = evaluate(model, test_x, test_y)
            print(f"epoch {epoch + 1}: train loss {total_loss / steps_per_epoch:.4f} test loss "
                  f"{test_loss:.4f} test accuracy {accuracy:.4f} "
                  f"({steps_per_epoch * global_batch / seconds:.0f} samples/s)", flush=True)
    finally:
        if agg is not None:
            agg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
