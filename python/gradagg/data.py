"""Sharded batches: each gradagg worker reads its own part of every global batch.

:class:`ShardedBatches` is built once, in the parent, from a map-style
``torch.utils.data.Dataset``; the workers (forked afterwards) call
``batch(ctx)`` in the shard function and get their part of the step's global
batch, collated with ``default_collate``. ``steps(epoch)`` lists an epoch's
:class:`gradagg.BatchPosition` s, as a DataLoader's epoch: ``agg.step(position)``
trains that batch::

    data = gradagg.data.ShardedBatches(dataset, 64, shuffle=True, seed=1)

    def shard(ctx):
        x, y = data.batch(ctx)                 # this worker's rows of ctx.position's batch
        return F.cross_entropy(model(x), y), len(x)

    with gradagg.Aggregator(model, shard, workers=4) as agg:
        for epoch in range(state.position.epoch, epochs):
            for position in data.steps(epoch, state.position):   # a resumed run: from there
                agg.step(position)
                opt.step()
            scheduler.step()

A step given a position reads that batch, whatever the steps before: leaving an
epoch early (a ``break``) does not shift the next epoch. A step without one
(``agg.step()``) reads the batch of its global step ``ctx.step``: epoch
``step // steps_per_epoch()``, batch ``step % steps_per_epoch()``.

The rule (the C++ ``gradagg::data::ShardedBatches`` is the same, bit for bit)::

    n = len(dataset), b = batch_size
    steps_per_epoch() = n // b if drop_last else ceil(n / b)
    position (e, p) = ctx.position, else (step // steps_per_epoch(), step % steps_per_epoch())
    order of epoch e = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))
                       if shuffle else 0, 1, ..., n - 1          (DistributedSampler's order)
    global batch at (e, p) = order of e [p * b : min((p + 1) * b, n)]
    worker g of G (ctx.global_rank of ctx.global_workers) takes a contiguous part:
        m = len(global batch); base, rem = divmod(m, G)
        start = g * base + min(g, rem); size = base + (1 if g < rem else 0)
    with gradient accumulation (micro_step u of M) that part is split again the
    same way into M contiguous parts.

Exactness: the parts of one step are disjoint and together are the global
batch, so with gradagg's default ``weighting="samples"`` and ``len(x)`` as the
sample count, ``.grad`` is the mean gradient over the global batch: what one
process computes over ``global_batch(position)``, whatever the number of workers,
nodes or micro-steps (up to the order of floating-point sums). The last batch of
an epoch may be smaller (unless ``drop_last``) and some workers may then get no
sample: ``batch(ctx)`` gives 0 rows, ``samples(ctx)`` is 0, and gradagg accepts
a shard with 0 samples (its loss is not used; ``return None, 0`` works too).

Everything is a pure function of (position, global rank): a restarted worker,
a redone step and a resume from a checkpoint (``TrainingState.position``) read
the same samples; there is no loader state to save.

What not to do: iterate a ``DataLoader`` inside the shard function. Each
worker has its own forked copy of a parent's iterator, so every worker reads
the *same* batch (and the parent's copy never moves): the step is then one
batch counted N times (gradagg prints a warning when every worker's gradient
is the same). One with worker processes (``num_workers > 0``), made in the
parent or in the shard function, is refused there with an InvalidArgument
(the parent gets WorkerFailed): use ``batch(ctx)`` (``num_workers=k`` here
loads in processes), or a ``DataLoader`` with ``num_workers=0`` over this
worker's part.
"""
import collections.abc
import ctypes
import functools
import multiprocessing.util
import os
import signal

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from gradagg._core import BatchPosition, _in_shard_function
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
    keys (epoch, index, micro_step) from `start` on, forever."""

    def __init__(self, owner, start, rank, workers, micro_steps):
        self.owner, self.start = owner, start
        self.rank, self.workers, self.micro_steps = rank, workers, micro_steps

    def __iter__(self):
        key = self.start  # has samples (batch() starts a loader only there)
        while True:
            epoch, index, micro = key
            yield self.owner._indices(epoch, index, self.rank, self.workers, micro,
                                      self.micro_steps)
            key = self.owner._next_key(key, self.rank, self.workers, self.micro_steps)


class ShardedBatches:
    """Each step's global batch of a map-style dataset, in parts for the workers.

    ``ShardedBatches(dataset, batch_size, *, shuffle=False, seed=0, drop_last=False,
    num_workers=0)``: built once in the parent, before the Aggregator, and used
    in the shard function through ``batch(ctx)``. See the module's docstring
    (``help(gradagg.data)``) for the exact rule; in short, the global batch at
    position (e, p) (``steps(e)`` lists them; a step without one: e = s //
    steps_per_epoch(), p = s % steps_per_epoch()) is the p-th ``batch_size``
    consecutive entries of epoch e's order (``torch.randperm`` seeded with
    ``seed + e`` when ``shuffle``, DistributedSampler's order), the last one
    shorter unless ``drop_last``, and worker g of G takes the g-th of G
    contiguous, nearly equal parts of it (then the micro-step's part of that
    with ``accumulation_steps``).

    With the default ``weighting="samples"`` and ``len(x)`` returned as the
    sample count, ``.grad`` is the mean gradient over the global batch, as one
    process over ``global_batch(position)`` gets it, for any number of workers.

    ``num_workers=k > 0`` loads in each gradagg worker through a
    ``torch.utils.data.DataLoader`` with k processes of its own, which prefetches
    the worker's next steps. It is made lazily in the gradagg worker (never in
    the process that built this object, which loads directly) and started again
    at the requested step when ``batch(ctx)`` asks for another step than the
    next one (it guesses the next micro-batch, else the next batch of the epoch,
    else the next epoch's first: a redone step, a restart, an epoch left early
    start it again). The batches are the same bits as with
    ``num_workers=0`` (random numbers drawn in ``dataset[i]`` aside: with 0 they
    come from the gradagg worker's generator, seeded each step, otherwise from
    the loader's processes). The loader's processes end with the thread that
    started them (PR_SET_PDEATHSIG), in a gradagg worker the worker's own:
    nothing is left when a worker exits or is killed.

    Do not iterate a DataLoader in the shard function: each worker has a forked
    copy of a parent's iterator and every worker would read the same batch (one
    with ``num_workers > 0`` is refused there with an InvalidArgument).
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
        self._expected = None     # the (epoch, index, micro_step) the iterator gives next
        self._last = None         # ((epoch, index, rank, workers, micro, micro_steps), batch)
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

    def position_of(self, step):
        """The position a step without one reads: BatchPosition(step // steps_per_epoch(),
        step % steps_per_epoch())."""
        return BatchPosition(*divmod(self._check_step(step), self._steps))

    def steps(self, epoch, start=None):
        """Epoch `epoch`'s positions, in order, as a DataLoader's epoch: ``for position in
        data.steps(epoch): agg.step(position)``. From `start` on (a BatchPosition: a resumed
        run's TrainingState.position): all of them when start.epoch < epoch, from start.index
        when it is `epoch`, none when later; None: all of them."""
        self._check_epoch(epoch)
        first = 0
        if start is not None:
            if not isinstance(start, BatchPosition):
                raise InvalidArgument(
                    f"start: expected a gradagg.BatchPosition or None, got {type(start).__name__}")
            if start.epoch > epoch:
                first = self._steps
            elif start.epoch == epoch:
                first = min(max(start.index, 0), self._steps)
        return [BatchPosition(epoch, i) for i in range(first, self._steps)]

    def order(self, epoch):
        """Epoch `epoch`'s sample order, an int64 tensor of length len(dataset)."""
        if self._order_epoch != epoch:
            self._check_epoch(epoch)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self._n, generator=g)
            else:
                self._order = torch.arange(self._n)
            self._order_epoch = epoch
        return self._order

    @staticmethod
    def _check_epoch(epoch):
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidArgument(f"epoch: expected an int >= 0, got {epoch!r}")
        return epoch

    def _check_step(self, step):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgument(f"step: expected an int >= 0, got {step!r}")
        return step

    def _at(self, at):
        """(epoch, index) of a step (an int) or a BatchPosition, validated."""
        if isinstance(at, BatchPosition):
            if at.epoch < 0 or not 0 <= at.index < self._steps:
                raise InvalidArgument(
                    f"position: batch {at.index} of epoch {at.epoch}: expected epoch >= 0 and "
                    f"0 <= batch < {self._steps} (the batches of an epoch of {self._n} samples "
                    f"in batches of {self.batch_size}"
                    f"{', the last one dropped' if self.drop_last else ''})")
            return at.epoch, at.index
        return divmod(self._check_step(at), self._steps)

    def _bounds(self, index, global_rank, global_workers, micro_step, micro_steps):
        """(lo, hi) of the part in the global batch `index` of its epoch, validated."""
        for name, value, count in (("global_rank", global_rank, global_workers),
                                   ("micro_step", micro_step, micro_steps)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise InvalidArgument(f"{name}: its count must be an int >= 1, got {count!r}")
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
                raise InvalidArgument(f"{name}: expected 0 <= {name} < {count}, got {value!r}")
        return self._bounds_unchecked(index, global_rank, global_workers, micro_step, micro_steps)

    def _bounds_unchecked(self, p, g, workers, u, micro_steps):
        m = min((p + 1) * self.batch_size, self._n) - p * self.batch_size
        start, size = _part(m, g, workers)
        sub, size = _part(size, u, micro_steps)
        return start + sub, start + sub + size

    def _size(self, index, g, workers, u, micro_steps):
        lo, hi = self._bounds_unchecked(index, g, workers, u, micro_steps)
        return hi - lo

    def _next_key(self, key, g, workers, micro_steps):
        """The (epoch, index, micro_step) after `key` where worker g has samples: the next
        micro-batch, else the next batch of the epoch, else the next epoch's first (the
        C++ prefetch's guess), skipping those where it has none."""
        epoch, index, micro = key
        while True:  # ends within one epoch: the sizes repeat every epoch, and this is
            # only asked for a worker that has samples at some key (batch() checks)
            micro += 1
            if micro == micro_steps:
                micro, index = 0, index + 1
                if index == self._steps:
                    index, epoch = 0, epoch + 1
            if self._size(index, g, workers, micro, micro_steps):
                return epoch, index, micro

    def indices(self, step, global_rank=0, global_workers=1, micro_step=0, micro_steps=1):
        """The dataset indices (a list of int) of worker `global_rank` of
        `global_workers` at `step` (a global step, or a BatchPosition) (micro-step
        `micro_step` of `micro_steps`); the defaults give the whole global batch."""
        return self._indices(*self._at(step), global_rank, global_workers, micro_step,
                             micro_steps)

    def _indices(self, epoch, index, global_rank, global_workers, micro_step, micro_steps):
        lo, hi = self._bounds(index, global_rank, global_workers, micro_step, micro_steps)
        start = index * self.batch_size
        return self.order(epoch)[start + lo:start + hi].tolist()

    def samples(self, ctx):
        """How many samples this worker has for `ctx` (0 at the end of an uneven epoch
        when there are more workers than samples left)."""
        _, index, *part = self._ctx_key(ctx)
        lo, hi = self._bounds(index, *part)
        return hi - lo

    def _ctx_key(self, ctx):
        """(epoch, index, global_rank, global_workers, micro_step, micro_steps) of ctx: at
        ctx.position when the step has one, else at ctx.step's."""
        position = getattr(ctx, "position", None)
        epoch, index = self._at(ctx.step if position is None else position)
        return epoch, index, ctx.global_rank, ctx.global_workers, ctx.micro_step, ctx.micro_steps

    # -- loading -----------------------------------------------------------------------------

    def _collate(self, idx):
        if not idx:
            if self._empty is None:
                sample = self.dataset[0]
                self._empty = _empty_like(default_collate([sample]), sample)
            return self._empty
        return default_collate([self.dataset[i] for i in idx])

    def global_batch(self, step):
        """The whole global batch of `step` (a global step, or a BatchPosition), collated
        (for a one-process reference on the same batches). Loaded here, in the calling
        process."""
        return self._collate(self.indices(step))

    def batch(self, ctx):
        """This worker's samples for `ctx` (its position, else its step; its global rank,
        micro-step), collated with default_collate: ``x, y = data.batch(ctx)`` for a
        TensorDataset. An empty part has the structure of one sample with 0 rows."""
        key = self._ctx_key(ctx)
        epoch, index, rank, workers, micro, micro_steps = key
        if self.num_workers == 0 or os.getpid() == self._pid:
            return self._collate(self._indices(*key))
        lo, hi = self._bounds(index, rank, workers, micro, micro_steps)
        if lo == hi:
            return self._collate([])
        if self._last is not None and self._last[0] == key:
            return self._last[1]  # asked twice in one call of the shard function
        if (self._iterator is None or self._loader_key != (rank, workers, micro_steps)
                or self._expected != (epoch, index, micro)):
            self._start_loader(key)
        out = next(self._iterator)
        self._expected = self._next_key((epoch, index, micro), rank, workers, micro_steps)
        self._last = (key, out)
        return out

    def _start_loader(self, key):
        self._stop_loader()
        epoch, index, rank, workers, micro, micro_steps = key
        sampler = _StepSampler(self, (epoch, index, micro), rank, workers, micro_steps)
        loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers,
                            collate_fn=default_collate,
                            # its own generator: the worker's torch generator (dropout,
                            # seeded by gradagg each step) draws nothing for the loader
                            generator=torch.Generator().manual_seed(self.seed),
                            worker_init_fn=functools.partial(_die_with_parent, os.getpid()))
        loader._gradagg_own = True  # made for this worker's part: allowed (see below)
        self._iterator = iter(loader)
        self._loader_key = (rank, workers, micro_steps)
        self._expected = (epoch, index, micro)

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


# -- a DataLoader with processes, iterated in a shard function --------------------------------
#
# In a gradagg worker it reads the wrong data, or fails late: a parent's loader is a forked
# copy (every worker reads the same batch; its processes are the parent's children, which
# torch cannot poll from here: "AssertionError: can only test a child process" once a batch
# is late), and one made there reads the whole dataset in every worker, the same batches
# again, in processes forked from a worker's thread. So while a shard
# function runs (gradagg._core._in_shard_function(): set by the worker around the call),
# iterating one is an InvalidArgument that says what to do instead; elsewhere (the parent,
# an evaluation loop, a DataLoader's own processes) nothing changes. Two hooks, patched
# once: DataLoader.__iter__ (before any process starts) and the multi-process iterator's
# _next_data (an iterator made in the parent and advanced here). ShardedBatches' own loader
# (num_workers=k: this worker's part, its processes tied to the worker) is marked and exempt.

def _refuse_in_shard_function(num_workers):
    raise InvalidArgument(
        f"a torch.utils.data.DataLoader with worker processes (num_workers={num_workers}) was "
        "iterated inside the shard function: every gradagg worker would read the same batches "
        "(a forked copy of the loader, or one over the whole dataset), in processes that are "
        "not tied to the worker. Use gradagg.data.ShardedBatches: data.batch(ctx) reads this "
        "worker's part of the step (ShardedBatches(..., num_workers=k) loads it in processes); "
        "or a DataLoader with num_workers=0 over this worker's part only "
        "(data.indices(ctx.position, ctx.global_rank, ctx.global_workers))")


def _guard_dataloaders():
    if getattr(DataLoader.__iter__, "_gradagg_guard", False):
        return  # patched already (the module reloaded)
    dataloader_iter, next_data = DataLoader.__iter__, _MultiProcessingDataLoaderIter._next_data

    @functools.wraps(dataloader_iter)
    def __iter__(self):
        own = getattr(self, "_gradagg_own", False)
        if self.num_workers > 0 and not own and _in_shard_function():
            _refuse_in_shard_function(self.num_workers)
        it = dataloader_iter(self)
        if own:
            it._gradagg_own = True
        return it

    @functools.wraps(next_data)
    def _next_data(self):
        if not getattr(self, "_gradagg_own", False) and _in_shard_function():
            _refuse_in_shard_function(self._num_workers)
        return next_data(self)

    __iter__._gradagg_guard = True
    DataLoader.__iter__ = __iter__
    _MultiProcessingDataLoaderIter._next_data = _next_data


_guard_dataloaders()
