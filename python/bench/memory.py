"""Does it matter where a worker's tensors live? One worker's forward and backward.

The 5.8M-parameter MLP (784-2048-2048-10) on one worker's shard (128 samples, one
intra-op thread), with its parameters and .grad in each kind of memory in turn,
interleaved so that every kind sees the same noise:

  torch          torch's own allocations (what a forked Gloo peer uses)
  shared         a shared anonymous mapping (what gradagg's segment is)
  private-huge   a private mapping advised MADV_HUGEPAGE
  shared-huge    a shared mapping advised likewise (no effect where the kernel's
                 shmem_enabled is 'never')
  P/G            parameters in P, .grad in G, e.g. shared/private-huge

    python3 python/bench/memory.py [KIND ...] [--reps N]

Prints the median and minimum ms per forward and backward for each kind and the
huge pages the process ended up with (AnonHugePages, ShmemPmdMapped).
See docs/benchmark.md, "What the 5.8M rows depended on".
"""
import argparse
import mmap
import re
import statistics
import time

import torch

SIZES = [784, 2048, 2048, 10]
SHARD = 128


def shapes():
    out = []
    for i in range(len(SIZES) - 1):
        out += [(SIZES[i + 1], SIZES[i]), (SIZES[i + 1],)]
    return out


class Regions:
    """Flat float32 regions of each kind; keeps the mappings alive."""

    def __init__(self, count):
        self.count = count
        self.maps = []

    def make(self, kind):
        if kind == "torch":
            return torch.empty(self.count)
        shared = kind.startswith("shared")
        m = mmap.mmap(-1, self.count * 4 + (2 << 20),
                      flags=mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE)
        if kind.endswith("-huge"):
            m.madvise(mmap.MADV_HUGEPAGE)
        self.maps.append(m)
        return torch.frombuffer(m, dtype=torch.float32)[: self.count]


def build(kind, regions, init):
    """Parameters (leaves) and their .grad as views of two regions of `kind`."""
    pk, gk = kind.split("/") if "/" in kind else (kind, kind)
    params_region, grads_region = regions.make(pk), regions.make(gk)
    params, offset = [], 0
    for value in init:
        n = value.numel()
        p = params_region[offset:offset + n].view(value.shape)
        p.copy_(value)
        p.requires_grad_(True)
        p.grad = grads_region[offset:offset + n].view(value.shape)
        params.append(p)
        offset += n
    return params


def step(params, x, y):
    h = x
    layers = len(params) // 2
    for i in range(layers):
        h = torch.nn.functional.linear(h, params[2 * i], params[2 * i + 1])
        if i + 1 < layers:
            h = torch.relu(h)
    loss = torch.nn.functional.cross_entropy(h, y)
    with torch.no_grad():
        for p in params:
            p.grad.zero_()
    loss.backward()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*",
                        default=["torch", "shared", "private-huge", "shared-huge"])
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init = [torch.randn(s) * 0.02 for s in shapes()]
    x, y = torch.randn(SHARD, SIZES[0]), torch.randint(0, SIZES[-1], (SHARD,))
    regions = Regions(sum(v.numel() for v in init))
    nets = {k: build(k, regions, init) for k in dict.fromkeys(args.kinds)}
    times = {k: [] for k in nets}
    for rep in range(args.reps + 2):  # two warm-up rounds
        for kind, params in nets.items():
            t0 = time.perf_counter()
            step(params, x, y)
            if rep >= 2:
                times[kind].append((time.perf_counter() - t0) * 1e3)
    for kind, ms in times.items():
        print(f"{kind:24s} median {statistics.median(ms):7.1f} ms   min {min(ms):7.1f} ms")
    with open("/proc/self/smaps_rollup") as f:
        print(", ".join(f"{k} {v}" for k, v in
                        re.findall(r"(AnonHugePages|ShmemPmdMapped):\s+(\d+ kB)", f.read())))


if __name__ == "__main__":
    main()
