"""Sharded batches: each gradagg worker reads its own part of every global batch.

:class:`ShardedBatches` is built once, in the parent, from a map-style
``torch.utils.data.Dataset``; the workers (forked afterwards) call
``batch(ctx)`` in the shard function and get their part of step ``ctx.step``'s
global batch, collated with ``default_collate``::

    data = gradagg.data.ShardedBatches(dataset, 64, shuffle=True, seed=1)

    def shard(ctx):
        x, y = data.batch(ctx)                 # this worker's rows of step ctx.step
        return F.cross_entropy(model(x), y), len(x)

    with gradagg.Aggregator(model, shard, workers=4) as agg:
        for step in range(epochs * data.steps_per_epoch()):
            agg.step()
            opt.step()

The rule (the C++ ``gradagg::data::ShardedBatches`` is the same, bit for bit)::

    n = len(dataset), b = batch_size
    steps_per_epoch() = n // b if drop_last else ceil(n / b)
    epoch e = step // steps_per_epoch(), position p = step % steps_per_epoch()
    order of epoch e = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))
                       if shuffle else 0, 1, ..., n - 1          (DistributedSampler's order)
    global batch of step = order[p * b : min((p + 1) * b, n)]
    worker g of G (ctx.global_rank of ctx.global_workers) takes a contiguous part:
        m = len(global batch); base, rem = divmod(m, G)
        start = g * base + min(g, rem); size = base + (1 if g < rem else 0)
    with gradient accumulation (micro_step u of M) that part is split again the
    same way into M contiguous parts.

Exactness: the parts of one step are disjoint and together are the global
batch, so with gradagg's default ``weighting="samples"`` and ``len(x)`` as the
sample count, ``.grad`` is the mean gradient over the global batch: what one
process computes over ``global_batch(step)``, whatever the number of workers,
nodes or micro-steps (up to the order of floating-point sums). The last batch of
an epoch may be smaller (unless ``drop_last``) and some workers may then get no
sample: ``batch(ctx)`` gives 0 rows, ``samples(ctx)`` is 0, and gradagg accepts
a shard with 0 samples (its loss is not used; ``return None, 0`` works too).

Everything is a pure function of (step, global rank): a restarted worker, a
redone step and a resume from a checkpoint (``start_step=``) read the same
samples; there is no loader state to save.

What not to do: iterate a ``DataLoader`` made in the parent inside the shard
function. Each worker has its own forked copy of the iterator, so every worker
reads the *same* batch (and the parent's copy never moves): the step is then
one batch counted N times. Use ``batch(ctx)``.
"""
import collections.abc
import ctypes
import functools
import multiprocessing.util
import os
import signal

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from gradagg.errors import InvalidArgument

__all__ = ["ShardedBatches"]


def _part(m, g, parts):
    """(start, size) of part g of `parts` contiguous parts of m items."""
    base, rem = divmod(m, parts)
    return g * base + min(g, rem), base + (1 if g < rem else 0)


def _empty_like(collated, sample):
    """The collated structure of one sample, cut to 0 rows."""
    if isinstance(collated, torch.Tensor):
        return collated[:0]
    if isinstance(sample, (str, bytes)):
        return collated[:0]  # default_collate keeps a batch of strings as a list
    if isinstance(collated, collections.abc.Mapping):
        items = {k: _empty_like(collated[k], sample[k]) for k in collated}
        try:
            return type(collated)(items)
        except TypeError:
            return items
    if isinstance(collated, tuple) and hasattr(collated, "_fields"):  # a namedtuple
        return type(collated)(*(_empty_like(c, s) for c, s in zip(collated, sample)))
    if isinstance(collated, collections.abc.Sequence):
        parts = [_empty_like(c, s) for c, s in zip(collated, sample)]
        try:
            return type(collated)(parts)
        except TypeError:
            return parts
    return collated


def _die_with_parent(parent, worker_id):
    """DataLoader worker_init_fn: end with the thread that started the loader.

    A gradagg worker leaves with _exit (or is killed), so the loader's own
    shutdown never runs there; PR_SET_PDEATHSIG makes its processes go with it
    instead of waiting as orphans for their 5 s watchdog."""
    del worker_id
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0 or os.getppid() != parent:  # PDEATHSIG
        os._exit(1)


class _StepSampler:
    """A DataLoader batch_sampler: this worker's non-empty index lists for the
    keys (step, micro_step) from `start` on, forever."""

    def __init__(self, owner, start, rank, workers, micro_steps):
        self.owner, self.start = owner, start
        self.rank, self.workers, self.micro_steps = rank, workers, micro_steps

    def __iter__(self):
        step, micro = self.start  # has samples (batch() starts a loader only there)
        while True:
            yield self.owner.indices(step, self.rank, self.workers, micro, self.micro_steps)
            step, micro = self.owner._next_key(step, micro, self.rank, self.workers,
                                               self.micro_steps)


class ShardedBatches:
    """Each step's global batch of a map-style dataset, in parts for the workers.

    ``ShardedBatches(dataset, batch_size, *, shuffle=False, seed=0, drop_last=False,
    num_workers=0)``: built once in the parent, before the Aggregator, and used
    in the shard function through ``batch(ctx)``. See the module's docstring
    (``help(gradagg.data)``) for the exact rule; in short, the global batch of
    step s is ``batch_size`` consecutive entries of epoch ``s // steps_per_epoch()``'s
    order (``torch.randperm`` seeded with ``seed + epoch`` when ``shuffle``,
    DistributedSampler's order), the last one shorter unless ``drop_last``, and
    worker g of G takes the g-th of G contiguous, nearly equal parts of it (then
    the micro-step's part of that with ``accumulation_steps``).

    With the default ``weighting="samples"`` and ``len(x)`` returned as the
    sample count, ``.grad`` is the mean gradient over the global batch, as one
    process over ``global_batch(step)`` gets it, for any number of workers.

    ``num_workers=k > 0`` loads in each gradagg worker through a
    ``torch.utils.data.DataLoader`` with k processes of its own, which prefetches
    the worker's next steps. It is made lazily in the gradagg worker (never in
    the process that built this object, which loads directly) and started again
    at the requested step when ``batch(ctx)`` asks for another step than the
    next one (a redone step, a restart). The batches are the same bits as with
    ``num_workers=0`` (random numbers drawn in ``dataset[i]`` aside: with 0 they
    come from the gradagg worker's generator, seeded each step, otherwise from
    the loader's processes). The loader's processes end with the thread that
    started them (PR_SET_PDEATHSIG), in a gradagg worker the worker's own:
    nothing is left when a worker exits or is killed.

    Do not iterate a parent's DataLoader in the shard function: each worker has
    a forked copy of the iterator and every worker would read the same batch.
    """

    def __init__(self, dataset, batch_size, *, shuffle=False, seed=0, drop_last=False,
                 num_workers=0):
        if isinstance(dataset, IterableDataset):
            raise InvalidArgument(
                "dataset: expected a map-style dataset (__getitem__ and __len__), got an "
                f"IterableDataset ({type(dataset).__name__}): its samples have no index to "
                "shard by")
        try:
            n = len(dataset)
        except TypeError:
            raise InvalidArgument(
                f"dataset: {type(dataset).__name__} has no __len__; ShardedBatches needs a "
                "map-style dataset whose length is known (to cut epochs and batches)") from None
        if not hasattr(dataset, "__getitem__"):
            raise InvalidArgument(
                f"dataset: {type(dataset).__name__} has no __getitem__ (a map-style dataset "
                "is indexed by sample number)")
        for name, value, low in (("batch_size", batch_size, 1), ("seed", seed, 0),
                                 ("num_workers", num_workers, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"{name}: expected an int, got {type(value).__name__}")
            if value < low:
                raise InvalidArgument(f"{name}: must be >= {low}, got {value}")
        if n == 0:
            raise InvalidArgument("dataset: it is empty (len(dataset) == 0): no batch to make")
        if drop_last and n < batch_size:
            raise InvalidArgument(
                f"drop_last with batch_size {batch_size} and only {n} samples: every batch "
                "would be dropped")
        self.dataset, self.batch_size, self.num_workers = dataset, batch_size, num_workers
        self.shuffle, self.seed, self.drop_last = bool(shuffle), seed, bool(drop_last)
        self._n = n
        self._steps = n // batch_size if drop_last else -(-n // batch_size)
        self._order_epoch, self._order = None, None
        self._empty = None
        # The loader (num_workers > 0): only in a process forked after this one.
        self._pid = os.getpid()
        self._loader_key = None   # (global_rank, global_workers, micro_steps) of the loader
        self._iterator = None
        self._expected = None     # the (step, micro_step) the iterator gives next
        self._last = None         # ((step, rank, workers, micro, micro_steps), batch)
        if num_workers:
            # The loader's processes pass tensors through sockets in multiprocessing's
            # temporary folder; made here, it is the parent's (removed when it exits),
            # not one per gradagg worker that a worker's _exit would leave behind.
            multiprocessing.util.get_temp_dir()

    # -- the rule ----------------------------------------------------------------------------

    def steps_per_epoch(self):
        """Steps in one pass over the dataset: n // b with drop_last, else ceil(n / b)."""
        return self._steps

    def epoch(self, step):
        """The epoch of `step`: step // steps_per_epoch()."""
        return self._check_step(step) // self._steps

    def order(self, epoch):
        """Epoch `epoch`'s sample order, an int64 tensor of length len(dataset)."""
        if self._order_epoch != epoch:
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise InvalidArgument(f"epoch: expected an int >= 0, got {epoch!r}")
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self._n, generator=g)
            else:
                self._order = torch.arange(self._n)
            self._order_epoch = epoch
        return self._order

    def _check_step(self, step):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgument(f"step: expected an int >= 0, got {step!r}")
        return step

    def _bounds(self, step, global_rank, global_workers, micro_step, micro_steps):
        """(lo, hi) of the part in the step's global batch, validated."""
        self._check_step(step)
        for name, value, count in (("global_rank", global_rank, global_workers),
                                   ("micro_step", micro_step, micro_steps)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise InvalidArgument(f"{name}: its count must be an int >= 1, got {count!r}")
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
                raise InvalidArgument(f"{name}: expected 0 <= {name} < {count}, got {value!r}")
        return self._bounds_unchecked(step, global_rank, global_workers, micro_step, micro_steps)

    def _bounds_unchecked(self, step, g, workers, u, micro_steps):
        p = step % self._steps
        m = min((p + 1) * self.batch_size, self._n) - p * self.batch_size
        start, size = _part(m, g, workers)
        sub, size = _part(size, u, micro_steps)
        return start + sub, start + sub + size

    def _size(self, step, g, workers, u, micro_steps):
        lo, hi = self._bounds_unchecked(step, g, workers, u, micro_steps)
        return hi - lo

    def _next_key(self, step, micro, g, workers, micro_steps):
        """The (step, micro_step) after (step, micro) where worker g has samples."""
        while True:  # ends within one epoch: the sizes repeat every epoch, and this is
            # only asked for a worker that has samples at some key (batch() checks)
            step, micro = (step, micro + 1) if micro + 1 < micro_steps else (step + 1, 0)
            if self._size(step, g, workers, micro, micro_steps):
                return step, micro

    def indices(self, step, global_rank=0, global_workers=1, micro_step=0, micro_steps=1):
        """The dataset indices (a list of int) of worker `global_rank` of
        `global_workers` in step `step` (micro-step `micro_step` of `micro_steps`);
        the defaults give the whole global batch."""
        lo, hi = self._bounds(step, global_rank, global_workers, micro_step, micro_steps)
        start = (step % self._steps) * self.batch_size
        return self.order(step // self._steps)[start + lo:start + hi].tolist()

    def samples(self, ctx):
        """How many samples this worker has for `ctx` (0 at the end of an uneven epoch
        when there are more workers than samples left)."""
        lo, hi = self._bounds(*self._ctx_key(ctx))
        return hi - lo

    @staticmethod
    def _ctx_key(ctx):
        return ctx.step, ctx.global_rank, ctx.global_workers, ctx.micro_step, ctx.micro_steps

    # -- loading -----------------------------------------------------------------------------

    def _collate(self, idx):
        if not idx:
            if self._empty is None:
                sample = self.dataset[0]
                self._empty = _empty_like(default_collate([sample]), sample)
            return self._empty
        return default_collate([self.dataset[i] for i in idx])

    def global_batch(self, step):
        """The whole global batch of `step`, collated (for a one-process reference on
        the same batches). Loaded here, in the calling process."""
        return self._collate(self.indices(step))

    def batch(self, ctx):
        """This worker's samples for `ctx` (its step, global rank, micro-step),
        collated with default_collate: ``x, y = data.batch(ctx)`` for a
        TensorDataset. An empty part has the structure of one sample with 0 rows."""
        key = self._ctx_key(ctx)
        if self.num_workers == 0 or os.getpid() == self._pid:
            return self._collate(self.indices(*key))
        lo, hi = self._bounds(*key)
        if lo == hi:
            return self._collate([])
        if self._last is not None and self._last[0] == key:
            return self._last[1]  # asked twice in one call of the shard function
        step, rank, workers, micro, micro_steps = key
        if (self._iterator is None or self._loader_key != (rank, workers, micro_steps)
                or self._expected != (step, micro)):
            self._start_loader(key)
        out = next(self._iterator)
        self._expected = self._next_key(step, micro, rank, workers, micro_steps)
        self._last = (key, out)
        return out

    def _start_loader(self, key):
        self._stop_loader()
        step, rank, workers, micro, micro_steps = key
        sampler = _StepSampler(self, (step, micro), rank, workers, micro_steps)
        loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers,
                            collate_fn=default_collate,
                            # its own generator: the worker's torch generator (dropout,
                            # seeded by gradagg each step) draws nothing for the loader
                            generator=torch.Generator().manual_seed(self.seed),
                            worker_init_fn=functools.partial(_die_with_parent, os.getpid()))
        self._iterator = iter(loader)
        self._loader_key = (rank, workers, micro_steps)
        self._expected = (step, micro)

    def _stop_loader(self):
        iterator, self._iterator, self._last = self._iterator, None, None
        if iterator is not None:
            iterator._shutdown_workers()  # joins its processes now, not at garbage collection

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_iterator=None, _loader_key=None, _expected=None, _last=None)
        return state

    def __repr__(self):
        return (f"gradagg.data.ShardedBatches({self._n} samples, batch_size="
                f"{self.batch_size}, shuffle={self.shuffle}, seed={self.seed}, drop_last="
                f"{self.drop_last}, num_workers={self.num_workers}, "
                f"{self._steps} steps per epoch)")
