#!/usr/bin/env python3
"""One process vs gradagg vs PyTorch DDP (Gloo) on the same models, side by side in one run.

For each model: the same network (cross-entropy, SGD), the same global batch,
measured as ms per optimizer step (forward, backward, gradient exchange, step):
  single   one process on the whole batch, intra-op threads = cores
  gradagg  gradagg.Aggregator, --workers workers, one thread each (the default)
  ddp      torch.nn.parallel.DistributedDataParallel, Gloo, --workers processes
           (one thread each), each on its share of the batch
  cpp      the C++ core on the same model (build/bench/gradagg-bench, shm mode):
           the gradagg row minus this one is what the Python layer costs per step
The models: ReLU MLPs (807, 55k, 670k) and the C++ bench's real networks (cnn, transformer,
lstm, or real for the three: nets.py, the same as bench/nets.h). Each model's modes run
--rounds times in turn (3), the steps split among them: a row is the mode's median round and
its speedup the median of the rounds' own. Prints a markdown table; --json writes one JSON
object per row (JSON Lines).

    PYTHONPATH=build/python python3 python/bench/bench.py --json build/python-bench.jsonl
    PYTHONPATH=build/python python3 python/bench/bench.py -m real
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import gradagg
import nets

# name: (spec, global batch, measured steps); a spec is a layer list or a nets.REAL name,
# and the real models' batches are gradagg-bench's defaults (bench/models.cpp).
MODELS = {
    "807": ([784, 1, 1, 10], 16, 2000),
    "55k": ([784, 64, 64, 10], 64, 400),
    "670k": ([784, 512, 512, 10], 256, 40),
    "cnn": ("cnn", 64, 20),
    "transformer": ("transformer", 8, 20),
    "lstm": ("lstm", 16, 20),
}
ALIASES = {"real": ["cnn", "transformer", "lstm"]}
LR = 0.01
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def timed(step, steps, warmup):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def summary(times):
    ms = sorted(t * 1e3 for t in times)
    return {"ms_per_step": statistics.fmean(ms), "median_ms": ms[len(ms) // 2],
            "p90_ms": ms[int(len(ms) * 0.9)]}


def run_single(spec, size, steps, warmup, threads_wanted=None):
    threads = torch.get_num_threads()
    threads_wanted = threads_wanted or os.cpu_count()
    torch.set_num_threads(threads_wanted)
    try:
        model = nets.build(spec)
        x, y = nets.batch(spec, size)
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return summary(timed(step, steps, warmup)) | {"procs": 1, "threads": threads_wanted}
    finally:
        torch.set_num_threads(threads)


def run_gradagg(spec, size, steps, warmup, workers):
    model = nets.build(spec)
    x, y = nets.batch(spec, size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def shard(ctx):
        lo, hi = size * ctx.rank // ctx.workers, size * (ctx.rank + 1) // ctx.workers
        return torch.nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi]), hi - lo

    binding = []  # the call from Python minus the C++ step it wraps

    with gradagg.Aggregator(model, shard, workers=workers) as agg:
        def step():
            t = time.perf_counter()
            report = agg.step()
            binding.append((time.perf_counter() - t) * 1e3 - report.total_ms)
            opt.step()
        times = timed(step, steps, warmup)
        threads = agg.threads_per_worker
    return summary(times) | {"procs": workers, "threads": threads,
                             "step_call_overhead_us": statistics.median(binding) * 1e3}


def ddp_worker(args):
    """One DDP process (--ddp-worker): prints its per-step times as JSON."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    spec = nets.parse(args.net)
    dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank,
                            world_size=args.world)
    model = torch.nn.parallel.DistributedDataParallel(nets.build(spec))
    x, y = nets.batch(spec, args.batch)
    lo = args.batch * args.rank // args.world
    hi = args.batch * (args.rank + 1) // args.world
    x, y = x[lo:hi], y[lo:hi]
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for _ in range(args.warmup):
        step()
    dist.barrier()
    times = timed(step, args.steps, 0)
    dist.destroy_process_group()
    if args.rank == 0:
        print(json.dumps(times))


def run_ddp(spec, size, steps, warmup, workers):
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        cmd = [sys.executable, os.path.abspath(__file__), "--ddp-worker",
               "--net", nets.label(spec), "--batch", str(size),
               "--steps", str(steps), "--warmup", str(warmup), "--world", str(workers),
               "--init-file", init]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(workers)]
        outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"DDP process failed: {err[-2000:]}")
    return summary(json.loads(outs[0][0])) | {"procs": workers, "threads": 1}


def run_cpp(spec, size, steps, warmup, workers, build, mode="shm", threads=None):
    exe = os.path.join(build, "bench", "gradagg-bench")
    if not os.path.exists(exe):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cpp.jsonl")
        extra = ["-t", str(threads)] if threads else []
        subprocess.run([exe, "-m", nets.label(spec), "-b", str(size), "--modes", mode,
                        "-w", str(workers), "-s", str(steps), "--warmup", str(warmup),
                        "--rounds", "1", "--json", out] + extra, check=True, capture_output=True, timeout=1800)
        with open(out) as f:
            row = json.loads(f.readline())
    return {"ms_per_step": row["ms_per_step"], "p90_ms": row["p90_ms"], "median_ms": None,
            "procs": workers, "threads": row["threads"]}


def run_mode(parser, mode, spec, size, steps, warmup, args):
    """One mode's result on one model, or None for cpp without a built gradagg-bench."""
    if mode == "single":
        return run_single(spec, size, steps, warmup)
    if mode == "gradagg":
        return run_gradagg(spec, size, steps, warmup, args.workers)
    if mode == "ddp":
        return run_ddp(spec, size, steps, warmup, args.workers)
    if mode == "cpp":
        return run_cpp(spec, size, steps, warmup, args.workers, args.build)
    parser.error(f"unknown mode {mode}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--models", default="807,55k,670k",
                        help=f"comma list of {', '.join(MODELS)}, real (the last three)")
    parser.add_argument("-w", "--workers", type=int, default=2)
    parser.add_argument("--modes", default="single,gradagg,ddp,cpp")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply every model's step count (e.g. 0.05 for a smoke run)")
    parser.add_argument("--steps", type=int,
                        help="measured steps for every model (default: its own, scaled)")
    parser.add_argument("--warmup", type=int,
                        help="unmeasured steps first (default: a tenth of the steps, at least 1)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run each model's modes this many times in turn, the steps split "
                             "among them; a row is its median round and its speedup the median "
                             "of the rounds' own (as gradagg-bench --rounds)")
    parser.add_argument("--json", help="write one JSON object per row here (JSON Lines)")
    parser.add_argument("--build", default=os.path.join(ROOT, "build"),
                        help="build folder with bench/gradagg-bench, for the cpp rows")
    # Internal: one DDP process.
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (("--net", str), ("--batch", int), ("--world", int), ("--rank", int),
                       ("--init-file", str)):
        parser.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        return ddp_worker(args)

    modes = args.modes.split(",")
    names = [n for item in args.models.split(",") for n in ALIASES.get(item, [item])]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)} (expected {', '.join(MODELS)}, real)")
    rows = []
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"machine: {os.cpu_count()} cores, {cpu}; torch {torch.__version__}; "
          f"{args.workers} workers")
    print("| model | params | batch | mode | procs x threads | ms/step | median ms | p90 ms "
          "| samples/s | speedup vs single |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        spec, size, steps = MODELS[name]
        steps = args.steps or max(3, int(steps * args.steps_scale))
        warmup = args.warmup if args.warmup is not None else max(1, steps // 10)
        params = sum(p.numel() for p in nets.build(spec).parameters())
        per_round = max(1, -(-steps // args.rounds))
        rounds = {}  # mode -> [(result, speedup against that round's single)]
        for k in range(args.rounds):
            single_ms = None
            line = []  # this round's ms per step, mode by mode (the median round hides them)
            for mode in modes:
                r = run_mode(parser, mode, spec, size, per_round, warmup, args)
                if r is None:
                    continue
                if mode == "single":
                    single_ms = r["ms_per_step"]
                sp = single_ms / r["ms_per_step"] if single_ms else None
                rounds.setdefault(mode, []).append((r, sp))
                line.append(f"{mode} {r['ms_per_step']:.4g}"
                            + (f" ({sp:.3g}x)" if sp and mode != "single" else ""))
            if args.rounds > 1:
                print(f"  {name} round {k + 1}/{args.rounds}: {', '.join(line)} ms",
                      file=sys.stderr, flush=True)
        for mode, results in rounds.items():
            results.sort(key=lambda rs: rs[0]["ms_per_step"])
            r = results[len(results) // 2][0]
            ratios = [sp for _, sp in results if sp is not None]
            speedup = statistics.median(ratios) if ratios else None
            row = {"model": nets.label(spec), "params": params, "batch": size,
                   "mode": mode, "steps": per_round * len(results), **r,
                   "samples_per_s": size / r["ms_per_step"] * 1e3,
                   "speedup_vs_single": speedup, "rounds": len(results),
                   "round_min_ms": results[0][0]["ms_per_step"],
                   "round_max_ms": results[-1][0]["ms_per_step"],
                   "cores": os.cpu_count(), "cpu": cpu, "torch": torch.__version__}
            rows.append(row)
            med = f"{r['median_ms']:.3f}" if r.get("median_ms") is not None else ""
            sp = f"{speedup:.2f}x" if speedup else ""
            print(f"| {row['model']} | {params} | {size} | {mode} | {r['procs']} x {r['threads']} "
                  f"| {r['ms_per_step']:.3f} | {med} | {r['p90_ms']:.3f} "
                  f"| {row['samples_per_s']:.0f} | {sp} |", flush=True)
        by_mode = {r["mode"]: r for r in rows if r["model"] == nets.label(spec)}
        if "gradagg" in by_mode and "cpp" in by_mode:
            # What Python costs anyway on one worker's share (forward, backward, SGD step in
            # one process, one thread), in Python and in C++: gradagg's critical path has the
            # same pieces, so what remains of the difference is gradagg's Python layer.
            share = size // args.workers
            py_share = run_single(spec, share, steps, warmup, threads_wanted=1)["ms_per_step"]
            cpp_share = run_cpp(spec, share, steps, warmup, 1, args.build, mode="single",
                                threads=1)["ms_per_step"]
            total = (by_mode["gradagg"]["ms_per_step"] - by_mode["cpp"]["ms_per_step"]) * 1e3
            torch_py = (py_share - cpp_share) * 1e3
            layer = {"model": by_mode["gradagg"]["model"], "params": params, "batch": size,
                     "mode": "python-layer", "gradagg_minus_cpp_us": total,
                     "one_share_python_minus_cpp_us": torch_py,
                     "python_layer_us": total - torch_py}
            rows.append(layer)
            print(f"| {layer['model']} | {params} | {size} | python layer: {total - torch_py:+.0f} "
                  f"us/step | (gradagg Python - C++ {total:+.0f} us; PyTorch's own Python cost "
                  f"on one {share}-sample share {torch_py:+.0f} us; the step() call itself "
                  f"{by_mode['gradagg']['step_call_overhead_us']:.1f} us) | | | | | |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
