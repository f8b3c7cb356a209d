#!/usr/bin/env python3
"""One process vs gradagg vs PyTorch DDP (Gloo) on the same models, side by side in one run.

For each model: the same network (cross-entropy, --optimizer: SGD, Adam or AdamW at lr 0.01),
the same global batch, measured as ms per optimizer step (forward, backward, gradient exchange,
step):
  single       one process on the whole batch, intra-op threads = cores, glibc's malloc as
               a user's script gets it (a fresh process each round)
  single-kept  the same with the heap gradagg's workers run with (keep_worker_memory:
               GLIBC_TUNABLES mmap_threshold 32 MiB, trim_threshold INT_MAX), so that a gain
               from the allocator is not read as one from parallelism (gradagg-bench's
               single-kept)
  gradagg      gradagg.Aggregator, --workers workers, one thread each (the default)
  ddp          torch.nn.parallel.DistributedDataParallel, Gloo, --workers processes
               (one thread each), each on its share of the batch
  cpp          the C++ core on the same model (build/bench/gradagg-bench, shm mode):
               the gradagg row minus this one is what the Python layer costs per step
The models: ReLU MLPs (807, 55k, 670k) and the C++ bench's real networks (cnn, transformer,
lstm, or real for the three: nets.py, the same as bench/nets.h). Each model's modes run
--rounds times in turn (3), the steps split among them: a row is the mode's median round and
its speedups the median of the rounds' own: against single, and for gradagg, ddp and cpp
against single-kept ("vs kept heap", speedup_vs_single_kept).
Prints the BLAS LibTorch calls (gradagg.blas_info()) and a markdown table; --json writes one
JSON object per row (JSON Lines), each with "optimizer" and "blas" (BlasInfo.to_dict()).

    PYTHONPATH=build/python python3 python/bench/bench.py --json build/python-bench.jsonl
    PYTHONPATH=build/python python3 python/bench/bench.py -m real --optimizer adam
"""
import argparse
import ctypes
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
    "5.8m": ([784, 2048, 2048, 10], 256, 20),
    "cnn": ("cnn", 64, 20),
    "transformer": ("transformer", 8, 20),
    "lstm": ("lstm", 16, 20),
}
ALIASES = {"real": ["cnn", "transformer", "lstm"]}
LR = 0.01
# --optimizer: the same names as gradagg-bench --optimizer; torch's defaults besides lr
# (Adam's and AdamW's betas, AdamW's weight decay), as torch::optim's there.
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# What gradagg's keepFreedMemory() sets with mallopt in each worker (src/runtime/heap.cpp):
# M_MMAP_THRESHOLD 32 MiB (the most glibc takes), M_TRIM_THRESHOLD INT_MAX. A tunable, like
# mallopt, also stops glibc from moving the threshold on its own.
KEPT_HEAP = {"glibc.malloc.mmap_threshold": "33554432",
             "glibc.malloc.trim_threshold": "2147483647"}
SINGLE_MODES = {"single": False, "single-kept": True}  # mode: runs with KEPT_HEAP
MODES = [*SINGLE_MODES, "gradagg", "ddp", "cpp"]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def make_optimizer(name, model):
    return OPTIMIZERS[name](model.parameters(), lr=LR)


def blas_info():
    """gradagg.blas_info(), or exit saying so: a module built before it cannot tell which BLAS
    this run measures, and a guess (torch.__config__) names the one torch was built with."""
    if not hasattr(gradagg, "blas_info"):
        sys.exit(f"bench.py: {gradagg.__file__} has no gradagg.blas_info() (a build older than "
                 "the BLAS report); rebuild the Python module or point PYTHONPATH at a newer one")
    return gradagg.blas_info()


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


def worker_cmd(flag, spec, size, steps, warmup, optimizer):
    """This script as one of its own internal processes (--single-worker, --ddp-worker)."""
    return [sys.executable, os.path.abspath(__file__), flag, "--net", nets.label(spec),
            "--batch", str(size), "--steps", str(steps), "--warmup", str(warmup),
            "--optimizer", optimizer]


def heap_env(kept):
    """This environment with glibc's malloc as gradagg's workers set it (kept) or as glibc
    starts (not kept): only the two thresholds change, other GLIBC_TUNABLES stay."""
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":")
                if t and t.split("=", 1)[0] not in KEPT_HEAP]
    if kept:
        tunables += [f"{name}={value}" for name, value in KEPT_HEAP.items()]
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def heap_keeps_large_chunks():
    """Whether glibc serves a 31 MiB malloc from the heap (the kept heap's threshold) rather
    than a fresh mapping; None where that cannot be seen (no glibc 2.33 mallinfo2). glibc
    ignores a misspelled tunable silently, so single-kept checks that its setting took.
    Only there: with glibc's own threshold, freeing the mapped chunk would raise it to 31 MiB,
    and single would no longer run with the heap a user's script starts with."""
    class Mallinfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    mapped = libc.mallinfo2().hblks
    p = libc.malloc(31 << 20)
    kept = libc.mallinfo2().hblks == mapped
    libc.free(p)
    return kept


def single_worker(args):
    """One process on the whole batch (--single-worker): prints its per-step times as JSON."""
    if args.kept_heap and heap_keeps_large_chunks() is False:
        sys.exit("single-kept: glibc did not take GLIBC_TUNABLES="
                 f"{os.environ.get('GLIBC_TUNABLES')} (a 31 MiB chunk was mapped)")
    torch.set_num_threads(args.threads)
    spec = nets.parse(args.net)
    model = nets.build(spec)
    x, y = nets.batch(spec, args.batch)
    opt = make_optimizer(args.optimizer, model)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    print(json.dumps(timed(step, args.steps, args.warmup)))


def run_single(spec, size, steps, warmup, optimizer, threads=None, kept_heap=False):
    """single / single-kept: each round in a fresh process, so neither inherits the heap
    this one's earlier rounds (and gradagg's parent) left behind."""
    threads = threads or os.cpu_count()
    cmd = worker_cmd("--single-worker", spec, size, steps, warmup, optimizer)
    cmd += ["--threads", str(threads)] + (["--kept-heap"] if kept_heap else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=heap_env(kept_heap),
                       timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"single process failed: {p.stderr[-2000:]}")
    return summary(json.loads(p.stdout)) | {"procs": 1, "threads": threads}


def run_gradagg(spec, size, steps, warmup, workers, optimizer):
    model = nets.build(spec)
    x, y = nets.batch(spec, size)
    opt = make_optimizer(optimizer, model)

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
    opt = make_optimizer(args.optimizer, model)

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


def run_ddp(spec, size, steps, warmup, workers, optimizer):
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        cmd = worker_cmd("--ddp-worker", spec, size, steps, warmup, optimizer) + [
            "--world", str(workers), "--init-file", init]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(workers)]
        outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"DDP process failed: {err[-2000:]}")
    return summary(json.loads(outs[0][0])) | {"procs": workers, "threads": 1}


def run_cpp(spec, size, steps, warmup, workers, build, optimizer, mode="shm", threads=None):
    exe = os.path.join(build, "bench", "gradagg-bench")
    if not os.path.exists(exe):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cpp.jsonl")
        extra = ["-t", str(threads)] if threads else []
        p = subprocess.run([exe, "-m", nets.label(spec), "-b", str(size), "--modes", mode,
                            "-w", str(workers), "-s", str(steps), "--warmup", str(warmup),
                            "--rounds", "1", "--optimizer", optimizer, "--json", out] + extra,
                           capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:  # e.g. a gradagg-bench built before --optimizer
            raise RuntimeError(f"{exe} failed: {p.stderr[-2000:]}")
        with open(out) as f:
            row = json.loads(f.readline())
    return {"ms_per_step": row["ms_per_step"], "p90_ms": row["p90_ms"], "median_ms": None,
            "procs": workers, "threads": row["threads"]}


def run_mode(mode, spec, size, steps, warmup, args):
    """One mode's result on one model, or None for cpp without a built gradagg-bench."""
    if mode in SINGLE_MODES:
        return run_single(spec, size, steps, warmup, args.optimizer,
                          kept_heap=SINGLE_MODES[mode])
    if mode == "gradagg":
        return run_gradagg(spec, size, steps, warmup, args.workers, args.optimizer)
    if mode == "ddp":
        return run_ddp(spec, size, steps, warmup, args.workers, args.optimizer)
    return run_cpp(spec, size, steps, warmup, args.workers, args.build, args.optimizer)


def speedups(mode, results, r):
    """r's speedup against each single mode this round ran: {single mode: ratio or None}. The
    single modes only against single, as in gradagg-bench: what the kept heap gains is
    single-kept's speedup, and single-kept against itself says nothing."""
    return {base: results[base]["ms_per_step"] / r["ms_per_step"]
            if base in results and (base == "single" or mode not in SINGLE_MODES) else None
            for base in SINGLE_MODES}


def round_entry(mode, r, sp):
    """'gradagg 3.1 (1.52x, 1.31x vs kept heap)': a mode in one round's stderr line."""
    ratios = []
    if mode != "single" and sp["single"]:
        ratios.append(f"{sp['single']:.3g}x")
    if sp["single-kept"]:
        ratios.append(f"{sp['single-kept']:.3g}x vs kept heap")
    return f"{mode} {r['ms_per_step']:.4g}" + (f" ({', '.join(ratios)})" if ratios else "")


def median_speedup(results, base):
    ratios = [sp[base] for _, sp in results if sp[base] is not None]
    return statistics.median(ratios) if ratios else None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--models", default="807,55k,670k",
                        help=f"comma list of {', '.join(MODELS)}, real (the last three)")
    parser.add_argument("-w", "--workers", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd",
                        help=f"every mode's optimizer, lr {LR}, torch's other defaults (sgd)")
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
    # Internal: one single-mode process, one DDP process.
    for flag in ("--single-worker", "--ddp-worker", "--kept-heap"):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (("--net", str), ("--batch", int), ("--world", int), ("--rank", int),
                       ("--init-file", str), ("--threads", int)):
        parser.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"unknown mode {', '.join(unknown)} (expected {', '.join(MODES)})")
    args.names = [n for item in args.models.split(",") for n in ALIASES.get(item, [item])]
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)} (expected {', '.join(MODELS)}, real)")
    return args


def main():
    args = parse_args()
    if args.single_worker:
        return single_worker(args)
    if args.ddp_worker:
        return ddp_worker(args)

    modes = args.modes.split(",")
    blas = blas_info()
    rows = []
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    # In every row: what every mode's processes ran with.
    run_info = {"optimizer": args.optimizer, "blas": blas.to_dict()}
    print(f"machine: {os.cpu_count()} cores, {cpu}; torch {torch.__version__}; "
          f"{args.workers} workers")
    print(f"blas: {blas}")
    if not blas.fast:  # the table would compare textbook loops, not what torch runs elsewhere
        print(f"bench.py: LibTorch's gemm is not a tuned BLAS here ({blas}); "
              "these figures say little about any other machine", file=sys.stderr)
    print(f"optimizer: {args.optimizer}, lr {LR}")
    print("| model | params | batch | mode | procs x threads | ms/step | median ms | p90 ms "
          "| samples/s | speedup vs single | vs kept heap |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.names:
        spec, size, steps = MODELS[name]
        steps = args.steps or max(3, int(steps * args.steps_scale))
        warmup = args.warmup if args.warmup is not None else max(1, steps // 10)
        params = sum(p.numel() for p in nets.build(spec).parameters())
        per_round = max(1, -(-steps // args.rounds))
        rounds = {}  # mode -> [(result, {single mode: speedup against that round's})]
        for k in range(args.rounds):
            results = {}  # this round's, mode by mode (the median round hides them)
            for mode in modes:
                r = run_mode(mode, spec, size, per_round, warmup, args)
                if r is not None:
                    results[mode] = r
            line = []
            for mode, r in results.items():
                sp = speedups(mode, results, r)
                rounds.setdefault(mode, []).append((r, sp))
                line.append(round_entry(mode, r, sp))
            if args.rounds > 1:
                print(f"  {name} round {k + 1}/{args.rounds}: {', '.join(line)} ms",
                      file=sys.stderr, flush=True)
        for mode, results in rounds.items():
            results.sort(key=lambda rs: rs[0]["ms_per_step"])
            r = results[len(results) // 2][0]
            speedup = median_speedup(results, "single")
            kept = median_speedup(results, "single-kept")
            row = {"model": nets.label(spec), "params": params, "batch": size,
                   "mode": mode, "steps": per_round * len(results), **r,
                   "samples_per_s": size / r["ms_per_step"] * 1e3,
                   "speedup_vs_single": speedup, "speedup_vs_single_kept": kept,
                   "rounds": len(results),
                   "round_min_ms": results[0][0]["ms_per_step"],
                   "round_max_ms": results[-1][0]["ms_per_step"],
                   "cores": os.cpu_count(), "cpu": cpu, "torch": torch.__version__, **run_info}
            rows.append(row)
            med = f"{r['median_ms']:.3f}" if r.get("median_ms") is not None else ""
            sp = f"{speedup:.2f}x" if speedup else ""
            sp_kept = f"{kept:.2f}x" if kept else ""
            print(f"| {row['model']} | {params} | {size} | {mode} | {r['procs']} x {r['threads']} "
                  f"| {r['ms_per_step']:.3f} | {med} | {r['p90_ms']:.3f} "
                  f"| {row['samples_per_s']:.0f} | {sp} | {sp_kept} |", flush=True)
        by_mode = {r["mode"]: r for r in rows if r["model"] == nets.label(spec)}
        if "gradagg" in by_mode and "cpp" in by_mode:
            # What Python costs anyway on one worker's share (forward, backward, optimizer step
            # in one process, one thread), in Python and in C++: gradagg's critical path has the
            # same pieces, so what remains of the difference is gradagg's Python layer.
            share = size // args.workers
            py_share = run_single(spec, share, steps, warmup, args.optimizer,
                                  threads=1)["ms_per_step"]
            cpp_share = run_cpp(spec, share, steps, warmup, 1, args.build, args.optimizer,
                                mode="single", threads=1)["ms_per_step"]
            total = (by_mode["gradagg"]["ms_per_step"] - by_mode["cpp"]["ms_per_step"]) * 1e3
            torch_py = (py_share - cpp_share) * 1e3
            layer = {"model": by_mode["gradagg"]["model"], "params": params, "batch": size,
                     "mode": "python-layer", "gradagg_minus_cpp_us": total,
                     "one_share_python_minus_cpp_us": torch_py,
                     "python_layer_us": total - torch_py, **run_info}
            rows.append(layer)
            print(f"| {layer['model']} | {params} | {size} | python layer: {total - torch_py:+.0f} "
                  f"us/step | (gradagg Python - C++ {total:+.0f} us; PyTorch's own Python cost "
                  f"on one {share}-sample share {torch_py:+.0f} us; the step() call itself "
                  f"{by_mode['gradagg']['step_call_overhead_us']:.1f} us) | | | | | | |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
