#!/usr/bin/env python3
"""Fashion-MNIST in Python: a 784-64-10 classifier trained with Adam by gradagg
workers (the parameter-server pattern: workers compute gradients on their
shards, the parent averages them and steps Adam), or in one process (--single)
on the same global batches. The data comes through gradagg.data.ShardedBatches:
each worker reads its own part of every global batch, chosen by the step alone.

    PYTHONPATH=build/python python3 python/examples/fashion_mnist.py --workers 2 --epochs 5

--checkpoint FILE saves the model, Adam, the position and the random states
(gradagg.Checkpoint: written whole or not at all, off the training thread) after
every epoch, and when stopped by Ctrl-C, SIGTERM or SIGHUP (gradagg.StopSignals:
the step in progress ends first; exit code 128 + the signal); --resume FILE goes
on from one, as if never stopped (try --stop-after N).

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
    p.add_argument("--checkpoint", metavar="FILE",
                   help="save model, optimizer, position and RNG to FILE after every epoch "
                        "and when stopped (Ctrl-C, SIGTERM, SIGHUP)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also every N steps")
    p.add_argument("--resume", metavar="FILE", help="continue from a checkpoint (same settings)")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="stop after N steps in all, as if interrupted (try --resume)")
    args = p.parse_args()
    if args.workers < 1 or args.batch < 1 or args.epochs < 0:
        p.error("--workers, --batch must be >= 1 and --epochs >= 0")
    if args.checkpoint_every < 0 or args.stop_after < 0:
        p.error("--checkpoint-every and --stop-after must be >= 0")
    # Checked now, before any training: a bad path fails at once, naming the file.
    checkpoint = gradagg.Checkpoint(args.checkpoint) if args.checkpoint else None
    # SIGINT, SIGTERM and SIGHUP: stop after the step in progress, with a checkpoint.
    with gradagg.StopSignals() as stop:
        return train(p, args, checkpoint, stop)


def train(p, args, checkpoint, stop):
    """The run: 0 when done (or --stop-after), 128 + the signal when stopped by one."""
    train_x, train_y = load(args.data, "train")
    test_x, test_y = load(args.data, "t10k")
    if args.limit:
        train_x, train_y = train_x[:args.limit], train_y[:args.limit]
    global_batch = args.batch * args.workers
    if len(train_x) < global_batch:
        p.error(f"fewer training samples ({len(train_x)}) than one global batch ({global_batch})")
    # Epoch e's order is randperm seeded with seed * 1000 + e; whole global batches only.
    data = gradagg.data.ShardedBatches(torch.utils.data.TensorDataset(train_x, train_y),
                                       global_batch, shuffle=True, seed=args.seed * 1000,
                                       drop_last=True)
    steps_per_epoch = data.steps_per_epoch()

    model = make_model(args.hidden, args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    # What changes the steps: a resume must have the same (--epochs may grow).
    settings = {"workers": args.workers, "batch": args.batch, "lr": args.lr, "seed": args.seed,
                "hidden": args.hidden, "limit": args.limit, "single": args.single}
    state, total_loss, total_correct = gradagg.TrainingState(), 0.0, 0
    if args.resume:
        # The model's Aggregator goes on from the checkpoint's step and position.
        state = gradagg.Checkpoint(args.resume, read_only=True).load(model, opt,
                                                                     settings=settings)
        total_loss = state.user.get("epoch_loss_sum", 0.0)
        total_correct = state.user.get("epoch_correct", 0)
    total_steps = args.epochs * steps_per_epoch

    # Worker ctx.rank's args.batch samples of the global batch at ctx.position: a function
    # of the position alone, so a restarted worker or a resumed run reads the same samples.
    # (Not a DataLoader iterated here: each worker would have a forked copy of it, all alike.)
    def shard(ctx):
        x, y = data.batch(ctx)
        out = model(x)
        correct = (out.argmax(1) == y).sum()  # summed over the workers
        return torch.nn.functional.cross_entropy(out, y), len(x), {"correct": correct}

    mode = "one process" if args.single else f"gradagg, {args.workers} workers"
    print(f"Fashion-MNIST: {len(train_x)} training samples, {mode}, global batch "
          f"{global_batch}, {steps_per_epoch} steps per epoch, Adam {args.lr}")
    step, position = state.step, state.position
    if args.resume and step >= total_steps:
        print(f"{args.resume} has done {step // steps_per_epoch} epochs: nothing left to "
              f"do (raise --epochs to go on)")
    elif args.resume:
        print(f"resumed from {args.resume} at step {step} of {total_steps}")
    last_step = min(total_steps, args.stop_after) if args.stop_after else total_steps

    saved = [(step, position)]

    def save():  # once per (step, position); an epoch's end has its loss sums done with
        if checkpoint is not None and saved[0] != (step, position):
            checkpoint.save(model, opt, step=step, position=position, settings=settings,
                            user={"epoch_loss_sum": total_loss, "epoch_correct": total_correct})
            saved[0] = (step, position)

    # Without start_step: a fresh run starts at step 0, a resumed one (the load above) at the
    # checkpoint's step and position, so its workers read the batches (and draw the random
    # numbers) of the run that was never stopped.
    agg = None if args.single or step >= last_step else gradagg.Aggregator(
        model, shard, workers=args.workers)
    try:
        for epoch in range(position.epoch, args.epochs):
            if step >= last_step or stop.requested:
                break
            progress = Progress(steps_per_epoch, f"epoch {epoch + 1}/{args.epochs}")
            begin, begin_step = time.monotonic(), step
            try:
                for at in data.steps(epoch, position):  # one epoch, as a DataLoader's
                    if step >= last_step or stop.requested:
                        break
                    if agg is not None:
                        report = agg.step(at)
                        loss, correct = report.loss, int(report.metrics["correct"])
                    else:  # the same global batch, whole
                        x, y = data.global_batch(at)
                        opt.zero_grad()
                        out = model(x)
                        loss_t = torch.nn.functional.cross_entropy(out, y)
                        loss_t.backward()
                        loss, correct = loss_t.item(), (out.argmax(1) == y).sum().item()
                    opt.step()
                    total_loss += loss
                    total_correct += correct
                    step, position = step + 1, at.next()
                    progress.update(1, loss)
                    if args.checkpoint_every and step % args.checkpoint_every == 0:
                        save()
            finally:
                progress.close()
            if position.index < steps_per_epoch:  # stopped mid-epoch
                break
            # What follows the epoch (also first thing after a resume from its last step).
            seconds = time.monotonic() - begin
            test_loss, accuracy = evaluate(model, test_x, test_y)
            print(f"epoch {epoch + 1}: train loss {total_loss / steps_per_epoch:.4f} train accuracy "
                  f"{total_correct / (steps_per_epoch * global_batch):.4f} test loss "
                  f"{test_loss:.4f} test accuracy {accuracy:.4f} "
                  f"({(step - begin_step) * global_batch / max(seconds, 1e-9):.0f} samples/s)",
                  flush=True)
            total_loss, total_correct, position = 0.0, 0, gradagg.BatchPosition(epoch + 1, 0)
            save()
    finally:
        if agg is not None:
            agg.close()
    if stop.requested:  # a second signal waits until the file is in place
        with stop.hold():
            save()
            if checkpoint is not None:
                checkpoint.wait()
        print(f"stopped at step {step} by signal {stop.signal}"
              + (f"; resume with --resume {args.checkpoint}" if checkpoint else ""), flush=True)
        return 128 + stop.signal
    if step < total_steps:  # --stop-after
        save()
        print(f"stopped after step {step}"
              + (f"; resume with --resume {args.checkpoint}" if checkpoint else ""))
    if checkpoint is not None:
        checkpoint.wait()  # the last file is in place (or its failure raised here)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except gradagg.CheckpointError as e:  # names the file and what is wrong with it
        sys.exit(f"fashion_mnist: {e}")
