"""gradagg.data.ShardedBatches: the index rule against hand-written and independent
expectations, training through it against one process on the same global batches,
resume mid-epoch, the DataLoader inside the workers, and bad input."""
import copy
import os
import signal
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import gradagg
from gradagg.data import ShardedBatches
from models import data, mlp


def ctx(step, rank=0, workers=1, micro=0, micro_steps=1):
    return SimpleNamespace(step=step, global_rank=rank, global_workers=workers,
                           micro_step=micro, micro_steps=micro_steps)


def dataset(n=17, seed=11):
    return TensorDataset(*data(n, seed=seed))


# -- the rule ----------------------------------------------------------------------------------

def test_the_rule_by_hand_ten_samples_batches_of_four_three_workers():
    d = ShardedBatches(TensorDataset(torch.arange(10)), 4)
    assert d.steps_per_epoch() == 3
    # step -> the three workers' parts, written out: 4 = 2+1+1, 4 = 2+1+1, 2 = 1+1+0.
    want = {0: [[0, 1], [2], [3]], 1: [[4, 5], [6], [7]], 2: [[8], [9], []],
            3: [[0, 1], [2], [3]], 5: [[8], [9], []]}
    for step, parts in want.items():
        assert [d.indices(step, g, 3) for g in range(3)] == parts, step
        assert [d.samples(ctx(step, g, 3)) for g in range(3)] == [len(p) for p in parts]
        assert d.indices(step) == sum(parts, [])
    assert d.epoch(2) == 0 and d.epoch(3) == 1
    # The empty part keeps the structure: one sample's collation with 0 rows.
    (empty,) = d.batch(ctx(2, 2, 3))
    assert empty.shape == (0,) and empty.dtype == torch.int64
    x, y = ShardedBatches(dataset(10), 4).batch(ctx(2, 2, 3))
    assert x.shape == (0, 5) and y.shape == (0, 3)

    dropped = ShardedBatches(TensorDataset(torch.arange(10)), 4, drop_last=True)
    assert dropped.steps_per_epoch() == 2
    assert [dropped.indices(2, g, 3) for g in range(3)] == [[0, 1], [2], [3]]  # epoch 1

    # Micro-steps split the worker's part again: 10 -> 5 + 5 -> (3 + 2), (3 + 2).
    m = ShardedBatches(TensorDataset(torch.arange(10)), 10)
    assert [[m.indices(0, g, 2, u, 2) for u in range(2)] for g in range(2)] == \
        [[[0, 1, 2], [3, 4]], [[5, 6, 7], [8, 9]]]


def test_the_shuffled_order_is_randperm_seeded_with_seed_plus_epoch():
    d = ShardedBatches(TensorDataset(torch.arange(10)), 4, shuffle=True, seed=5)
    for epoch in range(3):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        got = [d.indices(epoch * 3 + p, g, 3) for p in range(3) for g in range(3)]
        assert sum(got, []) == order, epoch
        assert [len(part) for part in got] == [2, 1, 1, 2, 1, 1, 1, 1, 0]
    first = [d.indices(s) for s in range(3)]
    assert [d.indices(s) for s in range(3, 6)] != first  # another epoch, another order


@pytest.mark.parametrize("n,b,workers,micro_steps", [(10, 4, 3, 1), (17, 8, 3, 2), (5, 5, 7, 1),
                                                     (23, 6, 2, 3), (9, 9, 1, 1)])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_rule_against_tensor_split(n, b, workers, micro_steps, shuffle, drop_last):
    """Independently: DistributedSampler's order cut by tensor_split, which gives the
    first m % G parts one more item, as the rule does."""
    d = ShardedBatches(TensorDataset(torch.arange(n)), b, shuffle=shuffle, seed=3,
                       drop_last=drop_last)
    steps = n // b if drop_last else (n + b - 1) // b
    assert d.steps_per_epoch() == steps
    for epoch in range(2):
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(3 + epoch))
                 if shuffle else torch.arange(n))
        seen = []
        for p in range(steps):
            step = epoch * steps + p
            global_batch = order[p * b:(p + 1) * b]
            assert d.indices(step) == global_batch.tolist()
            for g, part in enumerate(torch.tensor_split(global_batch, workers)):
                for u, micro in enumerate(torch.tensor_split(part, micro_steps)):
                    assert d.indices(step, g, workers, u, micro_steps) == micro.tolist()
                    assert d.samples(ctx(step, g, workers, u, micro_steps)) == len(micro)
                    seen += d.indices(step, g, workers, u, micro_steps)
        covered = steps * b if drop_last else n
        assert sorted(seen) == sorted(order[:covered].tolist())  # each sample once
        assert len(set(seen)) == covered


def test_batch_and_global_batch_collate_the_samples():
    ds = dataset(17)
    d = ShardedBatches(ds, 8, shuffle=True, seed=2)
    x, y = d.global_batch(4)
    idx = d.indices(4)
    assert torch.equal(x, ds.tensors[0][idx]) and torch.equal(y, ds.tensors[1][idx])
    parts = [d.batch(ctx(4, g, 3)) for g in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    dicts = ShardedBatches([{"a": torch.tensor([i, i]), "name": str(i)} for i in range(3)], 2)
    assert dicts.global_batch(1)["name"] == ["2"]
    empty = dicts.batch(ctx(1, 1, 2))
    assert empty["a"].shape == (0, 2) and empty["name"] == []


# -- training: the same as one process on the same global batches -------------------------------

def train_single(model, d, steps, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = d.global_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def shard_through(model, d):
    def shard(c):
        x, y = d.batch(c)
        return torch.nn.functional.mse_loss(model(x), y), len(x)
    return shard


@pytest.mark.parametrize("workers,accumulation", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_training_equals_one_process_over_two_uneven_shuffled_epochs(workers, accumulation):
    # 17 samples, batches of 8: 8, 8, 1 (the last leaves workers and micro-steps empty).
    d = ShardedBatches(dataset(17), 8, shuffle=True, seed=4)
    steps = 2 * d.steps_per_epoch()
    model = mlp()
    single = train_single(copy.deepcopy(model), d, steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with gradagg.Aggregator(model, shard_through(model, d), workers=workers,
                            accumulation_steps=accumulation) as agg:
        for step in range(steps):
            opt.zero_grad()
            report = agg.step()
            opt.step()
            assert report.samples == len(d.indices(step))
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_feeding_every_worker_the_same_batch_would_be_caught():
    """The comparison above can fail: workers that all read the global batch (what a
    forked copy of a parent's DataLoader iterator gives) train on other gradients."""
    d = ShardedBatches(dataset(17), 8, shuffle=True, seed=4)
    model = mlp()
    single = train_single(copy.deepcopy(model), d, 3)

    def shard(c):  # every worker takes the first worker's part: the trap's effect
        x, y = d.batch(ctx(c.step, 0, c.workers))
        return torch.nn.functional.mse_loss(model(x), y), len(x)

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with gradagg.Aggregator(model, shard, workers=2) as agg:
        for _ in range(3):
            opt.zero_grad()
            agg.step()
            opt.step()
    assert not all(torch.allclose(p, q, rtol=1e-5, atol=1e-6)
                   for p, q in zip(model.parameters(), single.parameters()))


def run(model, d, first, last, workers=2, **options):
    """Steps first..last-1 with Adam state carried in model._opt; dropout draws per step."""
    def shard(c):
        x, y = d.batch(c)
        return torch.nn.functional.mse_loss(model(x), y), len(x)

    with gradagg.Aggregator(model, shard, workers=workers, start_step=first, **options) as agg:
        for _ in range(first, last):
            model._opt.zero_grad()
            agg.step()
            model._opt.step()
    return model


def with_adam(model):
    model._opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model


def test_a_resume_mid_epoch_reads_the_batches_of_the_run_never_stopped():
    d = ShardedBatches(dataset(17), 8, shuffle=True, seed=9)   # 3 steps per epoch: 8, 8, 1
    steps = 2 * d.steps_per_epoch()
    straight = run(with_adam(mlp(dropout=True)), d, 0, steps)
    resumed = with_adam(mlp(dropout=True))
    run(resumed, d, 0, 4)            # stops in the middle of epoch 1
    run(resumed, d, 4, steps)        # a fresh Aggregator, start_step=4 (of 6)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(straight[0].weight, mlp(dropout=True)[0].weight)


# -- num_workers: a DataLoader inside each gradagg worker ---------------------------------------

def loader_pids():
    me = psutil.Process()
    workers = me.children()
    return {c.pid for w in workers for c in w.children(recursive=True)}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_num_workers_gives_the_same_bits_and_its_processes_go(accumulation):
    d0 = ShardedBatches(dataset(17), 4, shuffle=True, seed=9)
    d2 = ShardedBatches(dataset(17), 4, shuffle=True, seed=9, num_workers=2)
    steps = 2 * d0.steps_per_epoch()
    want = run(with_adam(mlp(dropout=True)), d0, 0, steps, workers=3,
               accumulation_steps=accumulation)
    model = with_adam(mlp(dropout=True))
    seen = set()

    def shard(c):
        x, y = d2.batch(c)
        assert d2.batch(c) is not None and len(d2.batch(c)[0]) == len(x)  # asked again
        return torch.nn.functional.mse_loss(model(x), y), len(x)

    with gradagg.Aggregator(model, shard, workers=3, accumulation_steps=accumulation) as agg:
        for step in range(steps):
            model._opt.zero_grad()
            agg.step()
            model._opt.step()
            seen |= loader_pids()
    assert seen  # the gradagg workers did start loader processes
    for p, q in zip(want.parameters(), model.parameters()):
        assert torch.equal(p, q)
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
              for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in seen if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"loader processes left: {alive}"


def test_num_workers_after_skipped_steps_a_redone_step_and_a_restart(tmp_path):
    """Steps a worker does not read, a failed step redone and a killed worker group
    re-forked: the loader starts again at the step asked for, and the result is
    num_workers=0's, bit for bit."""
    failed, killed = tmp_path / "failed", tmp_path / "killed"

    def train(d, inject):
        model = with_adam(mlp())

        def shard(c):
            if c.global_rank == 0 and c.step in (1, 6):
                return None, 0  # skips this step's part: the next read is not the next step
            x, y = d.batch(c)
            if inject and c.step == 2 and c.global_rank == 0 and not failed.exists():
                failed.touch()
                raise ValueError("a bad record")
            if inject and c.step == 7 and c.global_rank == 1 and not killed.exists():
                killed.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return torch.nn.functional.mse_loss(model(x), y), len(x)

        with gradagg.Aggregator(model, shard, workers=2, max_restarts=1) as agg:
            for step in range(2 * d.steps_per_epoch()):
                model._opt.zero_grad()
                try:
                    agg.step()
                except gradagg.WorkerFailed:
                    assert inject and step == 2
                    agg.step()
                model._opt.step()
        return model

    want = train(ShardedBatches(dataset(17), 4, shuffle=True, seed=1), False)
    got = train(ShardedBatches(dataset(17), 4, shuffle=True, seed=1, num_workers=2), True)
    assert failed.exists() and killed.exists()
    for p, q in zip(want.parameters(), got.parameters()):
        assert torch.equal(p, q)


def test_in_the_process_that_built_it_batch_loads_directly():
    d = ShardedBatches(dataset(9), 4, num_workers=2)
    x, _ = d.batch(ctx(1, 1, 2))
    assert len(x) == 2 and not psutil.Process().children()


# -- bad input ---------------------------------------------------------------------------------

class NoLength(Dataset):
    def __getitem__(self, i):
        return torch.zeros(2)


class Stream(IterableDataset):
    def __iter__(self):
        return iter([torch.zeros(2)])


@pytest.mark.parametrize("make,match", [
    (lambda: ShardedBatches(NoLength(), 4), "NoLength has no __len__"),
    (lambda: ShardedBatches(Stream(), 4), "IterableDataset"),
    (lambda: ShardedBatches(dataset(4), 0), "batch_size: must be >= 1, got 0"),
    (lambda: ShardedBatches(dataset(4), 2.0), "batch_size: expected an int, got float"),
    (lambda: ShardedBatches(TensorDataset(torch.zeros(0, 2)), 4), "empty"),
    (lambda: ShardedBatches(dataset(3), 4, drop_last=True), "batch_size 4 and only 3 samples"),
    (lambda: ShardedBatches(dataset(4), 2, seed=-1), "seed: must be >= 0, got -1"),
    (lambda: ShardedBatches(dataset(4), 2, num_workers=-2), "num_workers: must be >= 0"),
    (lambda: ShardedBatches(dataset(4), 2).indices(0, 2, 2), "0 <= global_rank < 2, got 2"),
    (lambda: ShardedBatches(dataset(4), 2).indices(-1), "step: expected an int >= 0, got -1"),
    (lambda: ShardedBatches(dataset(4), 2).samples(ctx(0, 0, 1, 1, 1)), "micro_step < 1, got 1"),
])
def test_bad_input_is_an_invalid_argument_naming_the_value(make, match):
    with pytest.raises(gradagg.InvalidArgument, match=match):
        make()


def test_it_is_part_of_the_package():
    assert gradagg.data.ShardedBatches is ShardedBatches
    assert "steps per epoch" in repr(ShardedBatches(dataset(4), 2))
    assert "randperm" in gradagg.data.__doc__ and "same batch" in ShardedBatches.__doc__
