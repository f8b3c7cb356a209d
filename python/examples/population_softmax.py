#!/usr/bin/env python3
"""Population-based training of softmax regression on Fashion-MNIST (gradagg.Population):
4 workers, each with its own [784, 10] weight, [10] bias, SGD and a learning rate drawn
log-uniformly; every --interval steps each publishes its weights and validation accuracy,
and a policy decides whether it copies a peer. The Python port of
examples/population_softmax.cpp: the same flags, the same numbers.

    PYTHONPATH=build/python python3 python/examples/population_softmax.py --policy truncation
    population_softmax.py --policy random --p 0.15 --steps 2000 --lineage lineage.jsonl
    population_softmax.py --checkpoint pop.ckpt      # Ctrl-C, then:
    population_softmax.py --resume pop.ckpt --checkpoint pop.ckpt

Errors end it with one line and the C++ examples' exit code (docs/errors.md): 2 bad input
(a flag, the data files), 3 the training failed, 4 a file could not be written or read,
128 + signal when stopped by SIGINT, SIGTERM or SIGHUP (after writing --checkpoint).

Data: Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist), or --data DIR
with the four IDX .gz files.
"""
import argparse
import gzip
import math
import os
import sys
import time

import numpy as np
import torch

import gradagg

PROGRAM = "population_softmax"
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
DEBIAN_PACKAGE = "dataset-fashion-mnist"
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")
# Exit codes of the examples (examples/exit_status.h).
DONE, BAD_INPUT, TRAINING_FAILED, FILE_FAILED, INTERNAL_ERROR = 0, 2, 3, 4, 70


class BadData(Exception):
    """A missing or malformed data file (the C++ idx::Error): exit code 2."""


def find_file(data_dir, name):
    """DIR/NAME.gz, or DIR/NAME uncompressed, as the C++ idx::readMnistDir looks for them."""
    gz = os.path.join(data_dir, name + ".gz")
    if os.path.exists(gz):
        return gz
    if os.path.exists(os.path.join(data_dir, name)):
        return os.path.join(data_dir, name)
    if data_dir.rstrip("/") == DEBIAN_DIR:
        hint = (f"it comes with the Debian package {DEBIAN_PACKAGE}: "
                f"apt-get install {DEBIAN_PACKAGE}")
    else:
        hint = f"expected {', '.join(f + '.gz' for f in FILES[:3])} and {FILES[3]}.gz in {data_dir}"
    raise BadData(f"idx: missing file {gz} ({hint})")


def read_idx(path, magic, dims):
    """The IDX file at `path` as a uint8 tensor (python/examples/fashion_mnist.py's reader)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BadData(f"idx: {path}: {e}") from None
    header = np.frombuffer(raw[:4 + 4 * dims], dtype=">u4")
    if len(header) != 1 + dims or header[0] != magic:
        raise BadData(f"idx: {path}: not an IDX file of {dims} dimensions")
    shape = [int(v) for v in header[1:]]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if data.size != int(np.prod(shape)):
        raise BadData(f"idx: {path}: truncated")
    if dims == 3 and shape[0] == 0:
        raise BadData(f"{path}: holds no images")
    return torch.from_numpy(data.copy()).reshape(shape)


def load(data_dir, split):
    """Images as float32 [n, 784] in [0, 1], labels as int64 [n] (idx_tensor.h's ops)."""
    images = read_idx(find_file(data_dir, f"{split}-images-idx3-ubyte"), 0x803, 3)
    labels = read_idx(find_file(data_dir, f"{split}-labels-idx1-ubyte"), 0x801, 1)
    if len(images) != len(labels):
        raise BadData(f"idx: {data_dir}: {len(images)} {split} images but {len(labels)} labels")
    return images.reshape(len(images), -1).float().div_(255.0), labels.long()


class Softmax(torch.nn.Module):
    """logits = x W + b, with W [784, 10] and b [10] (registered in that order)."""

    def __init__(self):
        super().__init__()
        self.register_parameter("weight", torch.nn.Parameter(torch.zeros(784, 10)))
        self.register_parameter("bias", torch.nn.Parameter(torch.zeros(10)))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


def accuracy(model, x, y):
    with torch.no_grad():
        return model(x).argmax(1).eq(y).to(torch.float64).mean().item()


def shortest(value):
    """A double as fmt's {} writes it (shortest round trip, no trailing .0)."""
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="random",
                   choices=["random", "truncation", "tournament", "none"])
    p.add_argument("--p", type=float, default=0.15,
                   help="random: probability of copying a random peer")
    p.add_argument("--fraction", type=float, default=0.25, help="truncation: bottom/top fraction")
    p.add_argument("--steps", type=int, default=2000, help="SGD steps per worker")
    p.add_argument("--interval", type=int, default=100, help="steps between publish points")
    p.add_argument("--batch", type=int, default=64, help="minibatch size")
    p.add_argument("--workers", type=int, default=4, help="population size")
    p.add_argument("--seed", type=int, default=1, help="seed of every random choice")
    p.add_argument("--lr-min", type=float, default=1e-4,
                   help="learning rates are drawn log-uniformly from [lr-min, lr-max]")
    p.add_argument("--lr-max", type=float, default=1.0)
    p.add_argument("--lineage", default="", help="JSON Lines file, one line per copy (appended)")
    p.add_argument("--data", default=DEBIAN_DIR,
                   help="directory with the four Fashion-MNIST IDX files")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds a member may take for one phase of a generation (default 300)")
    p.add_argument("--checkpoint", default="", metavar="FILE",
                   help="write the whole population to FILE at the end and when stopped "
                        "(Ctrl-C, SIGTERM, SIGHUP)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also write it every N steps (rounded up to a publish point)")
    p.add_argument("--resume", default="", metavar="FILE",
                   help="start every member from a --checkpoint file")
    args = p.parse_args()  # a bad flag: argparse's message and exit code 2
    if not 0.0 <= args.p <= 1.0:
        p.error(f"--p {args.p} is not in [0, 1]")
    if not 0.0 <= args.fraction <= 0.5:
        p.error(f"--fraction {args.fraction} is not in [0, 0.5]")
    for name in ("steps", "interval", "batch", "lr_min", "lr_max", "step_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 1 <= args.workers <= 16:
        p.error(f"--workers {args.workers} is not in [1, 16]")
    if args.seed < 0 or args.seed >= 1 << 64:
        p.error(f"--seed {args.seed} is not an unsigned 64-bit number")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    if args.lr_min > args.lr_max:
        raise ValueError(f"--lr-min {shortest(args.lr_min)} is above --lr-max "
                         f"{shortest(args.lr_max)}")
    return args


def run():
    args = parse_args()
    # Checked now, not when the first checkpoint is due.
    checkpoint = gradagg.Checkpoint(args.checkpoint) if args.checkpoint else None
    # SIGINT, SIGTERM and SIGHUP: stop after the current generation (exit_status.h's
    # installStopSignals, the C++ gradagg::StopSignals itself).
    with gradagg.StopSignals() as stop:
        return train(args, checkpoint, stop)


def train(args, checkpoint, stop):
    try:
        all_x, all_y = load(args.data, "train")
        test_x, test_y = load(args.data, "t10k")
    except BadData as e:
        print(f"{PROGRAM}: {e}", file=sys.stderr)
        return BAD_INPUT
    # The first 50,000 training images train, the last 10,000 score (validation).
    train_x, train_y = all_x[:50000], all_y[:50000]
    val_x, val_y = all_x[50000:], all_y[50000:]
    batch, lr_min, lr_max = args.batch, args.lr_min, args.lr_max

    model = Softmax()

    def hyperparams(rank, rng):
        return {"lr": math.exp(math.log(lr_min)
                               + rng.uniform() * (math.log(lr_max) - math.log(lr_min)))}

    def make_optimizer(hp):  # in the member: model is its own copy
        return torch.optim.SGD(model.parameters(), lr=hp["lr"])

    def train_step(ctx):
        start = ctx.rng.below(50000 - batch)
        ctx.optimizer.zero_grad()  # LibTorch 1.13's zero_grad: zeroes, never None
        torch.nn.functional.cross_entropy(model(train_x[start:start + batch]),
                                          train_y[start:start + batch]).backward()
        ctx.optimizer.step()

    def score(ctx):
        return accuracy(model, val_x, val_y)

    policy = {"random": lambda: gradagg.Policy.random(args.p),
              "truncation": lambda: gradagg.Policy.truncation(args.fraction),
              "tournament": gradagg.Policy.tournament,
              "none": gradagg.Policy.none}[args.policy]()
    with gradagg.Population(model, make_optimizer=make_optimizer, hyperparams=hyperparams,
                            train_step=train_step, score=score, workers=args.workers,
                            publish_interval=args.interval, seed=args.seed,
                            higher_is_better=True, policy=policy, lineage_path=args.lineage,
                            resume_from=args.resume,
                            step_timeout=args.step_timeout) as population:
        copies = 0
        steps, interval = args.steps, args.interval

        # A second Ctrl-C while a checkpoint is written waits until the file is in place.
        def save():
            with stop.hold():
                population.checkpoint(checkpoint.path)

        # A resumed population goes on from its members' step.
        saved_at = done = first_step = population.snapshot(0).step
        # Members' throughput: the generations' wall time alone (no data loading, saving or testing).
        training = 0.0
        while done < steps:
            started = time.perf_counter()
            copies += len(population.generation())
            training += time.perf_counter() - started
            if (checkpoint is not None and args.checkpoint_every > 0
                    and done + interval - saved_at >= args.checkpoint_every
                    and done + interval < steps):
                save()
                saved_at = done + interval
            if stop.requested:
                if checkpoint is not None:
                    save()
                where = f"; resume with --resume {checkpoint.path}" if checkpoint else ""
                print(f"stopped at step {population.snapshot(0).step}{where}", flush=True)
                return 128 + stop.signal
            done += interval
        if checkpoint is not None:
            save()
        trained = population.snapshot(0).step - first_step
        print("trained %d steps per member in %.2f s of generations: %.1f steps/s per member"
              % (trained, training, trained / training if training > 0 else 0.0), file=sys.stderr)

        # Score every member's final snapshot on the test set, here in the parent.
        best, mean, best_rank = 0.0, 0.0, 0
        workers = args.workers
        print("policy %s, %d workers, %d steps each, %d copies"
              % (population.policy_name, workers, population.snapshot(0).step, copies))
        for r in range(workers):
            s = population.snapshot(r)
            m = Softmax()
            with torch.no_grad():
                m.weight.copy_(s.parameters[0])
                m.bias.copy_(s.parameters[1])
            test = accuracy(m, test_x, test_y)
            mean += test / workers
            if test > best:
                best, best_rank = test, r
            print("  worker %d: validation accuracy %.4f, test accuracy %.4f, lr %.6g"
                  % (r, s.score, test, s.hyperparams["lr"]))
        print("best test accuracy %.4f (worker %d), mean %.4f" % (best, best_rank, mean))
    return DONE


def exit_code_for(e):
    """exit_status.h's exitCodeFor: the code a script can act on."""
    if isinstance(e, gradagg.FileError):  # CheckpointError among them
        return FILE_FAILED
    if isinstance(e, ValueError):  # gradagg.InvalidArgument is one
        return BAD_INPUT
    if isinstance(e, gradagg.InternalError):
        return INTERNAL_ERROR
    if isinstance(e, (gradagg.Error, OSError)):
        return TRAINING_FAILED
    return INTERNAL_ERROR


def main():
    try:
        return run()
    except Exception as e:  # noqa: BLE001  one line and a code, as the C++ examples
        print(f"{PROGRAM}: {e}", file=sys.stderr)
        return exit_code_for(e)


if __name__ == "__main__":
    sys.exit(main())
