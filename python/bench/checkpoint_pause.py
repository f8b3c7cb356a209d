"""How long does gradagg.Checkpoint.save() pause the training loop?

A ~14 MB state: a 784-1024-384-10 MLP (1.2M float32 parameters) with Adam's two
moments, its parameters in an Aggregator's shared segment, as when a run saves.
Interleaved, each --runs times (every save waits for the previous file first):

  torch.save     torch.save({model, optimizer state_dicts}) to a file in --dir
                 (page cache only: no fsync, no rename), what a plain script does
  save() pause   gradagg Checkpoint.save() until it returns: the content serialised
                 in memory, the file handed to the writer thread
  until wait()   save() and wait(): the file written, fsync'ed, renamed, the
                 directory fsync'ed

    PYTHONPATH=build/python python3 python/bench/checkpoint_pause.py [--runs N] [--dir DIR]

Prints the median and minimum ms of each and the file's size. See docs/python.md,
"Checkpoints".
"""
import argparse
import os
import statistics
import tempfile
import time

import torch

import gradagg

SIZES = [784, 1024, 384, 10]


def make_training():
    torch.manual_seed(1)
    layers = []
    for i in range(len(SIZES) - 1):
        layers += [torch.nn.Linear(SIZES[i], SIZES[i + 1]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step: Adam has its moments
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def ms(seconds):
    return seconds * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    args = p.parse_args()

    model, opt = make_training()
    params = sum(t.numel() for t in model.parameters())
    x = torch.randn(8, SIZES[0])

    def shard(ctx):
        rows = x[ctx.rank * 4:ctx.rank * 4 + 4]
        return model(rows).square().mean(), 4

    work = tempfile.mkdtemp(prefix="checkpoint_pause.", dir=args.dir)
    plain_path, ckpt_path = os.path.join(work, "plain.pt"), os.path.join(work, "run.ckpt")
    ckpt = gradagg.Checkpoint(ckpt_path)
    times = {"torch.save": [], "save() pause": [], "until wait()": []}
    try:
        with gradagg.Aggregator(model, shard, workers=2) as agg:
            agg.step()
            opt.step()
            for run in range(args.runs + 1):  # the first: warm-up, not counted
                begin = time.perf_counter()
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                           plain_path)
                plain = time.perf_counter() - begin

                ckpt.wait()
                begin = time.perf_counter()
                ckpt.save(model, opt, step=run)
                pause = time.perf_counter() - begin
                ckpt.wait()
                total = time.perf_counter() - begin
                if run:
                    times["torch.save"].append(plain)
                    times["save() pause"].append(pause)
                    times["until wait()"].append(total)
        size = os.path.getsize(ckpt_path)
    finally:
        del ckpt
        for name in os.listdir(work):
            os.remove(os.path.join(work, name))
        os.rmdir(work)

    print(f"state: {'-'.join(map(str, SIZES))} MLP, {params} float32 parameters, Adam; "
          f"checkpoint {size / 1e6:.1f} MB in {args.dir}; {args.runs} runs")
    print("| what | median ms | min ms |")
    print("|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {ms(statistics.median(values)):.1f} | {ms(min(values)):.1f} |")
    ratio = statistics.median(times["save() pause"]) / statistics.median(times["torch.save"])
    print(f"save() pause / torch.save: {ratio:.2f}x")


if __name__ == "__main__":
    main()
