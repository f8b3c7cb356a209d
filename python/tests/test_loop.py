"""The user's loop cannot go silently wrong (issue 45): a resumed run goes on from its
checkpoint's step and data position without start_step=; steps at BatchPositions read
ShardedBatches' batches whatever the loop left out; a per-epoch scheduler resumes from any
step; the workers' seeds follow torch.manual_seed; checkpoints are written off the training
thread with their failures still raised; workers that all computed the same gradient are
reported; a DataLoader with processes in the shard function is refused at once; and
StopSignals turns Ctrl-C into a stop checkpoint."""
import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gradagg
from gradagg import BatchPosition, Checkpoint
from gradagg.data import ShardedBatches

PYTHONPATH = os.pathsep.join(p for p in sys.path if p)


def dropout_model(seed=5):
    """float64, so that the one-process references compare at 1e-12."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(16, 3)).double()


def dataset(n=20, seed=11):
    """x, y and each sample's index (to see which samples a step read)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, y, torch.arange(n, dtype=torch.float64))


def shard_of(model, d):
    def shard(ctx):
        x, y, ids = d.batch(ctx)
        return F.mse_loss(model(x), y), len(x), {"ids": ids.sum().item()}
    return shard


def same_parameters(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# -- a: a resume needs no start_step ------------------------------------------------------------

STEPS, SAVED_AT = 7, 3


def test_a_load_gives_the_aggregator_the_checkpoints_step_without_start_step(tmp_path):
    d = ShardedBatches(dataset(), 8, shuffle=True, seed=3)  # 3 steps per epoch: 8, 8, 4
    whole = dropout_model()
    opt = torch.optim.Adam(whole.parameters(), lr=0.01)
    ckpt = Checkpoint(tmp_path / "run.ckpt")
    with gradagg.Aggregator(whole, shard_of(whole, d), workers=2) as agg:
        for _ in range(STEPS):
            opt.zero_grad()
            agg.step()
            opt.step()
            if agg.steps_done == SAVED_AT:
                ckpt.save(whole, opt, step=agg.steps_done)
    ckpt.wait()

    # A fresh process's objects: another initialisation, another torch seed, then the load.
    resumed = dropout_model(seed=99)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    torch.manual_seed(1234)
    assert Checkpoint(ckpt.path, read_only=True).load(resumed, resumed_opt).step == SAVED_AT
    with gradagg.Aggregator(resumed, shard_of(resumed, d), workers=2) as agg:  # no start_step
        assert agg.steps_done == SAVED_AT
        for step in range(SAVED_AT, STEPS):
            resumed_opt.zero_grad()
            assert agg.step().step == step
            resumed_opt.step()
    assert same_parameters(resumed, whole)

    # A start_step that is not the checkpoint's is refused before any worker starts; the
    # checkpoint's own is fine.
    reader = Checkpoint(ckpt.path, read_only=True)
    reader.load(resumed, resumed_opt)
    with pytest.raises(gradagg.InvalidArgument, match=f"at step {SAVED_AT}: leave start_step"):
        gradagg.Aggregator(resumed, shard_of(resumed, d), workers=2, start_step=5)
    reader.load(resumed, resumed_opt)
    with gradagg.Aggregator(resumed, shard_of(resumed, d), workers=2,
                            start_step=SAVED_AT) as agg:
        assert agg.steps_done == SAVED_AT


def test_a_load_into_the_model_of_a_live_aggregator_moves_it_to_the_checkpoint(tmp_path):
    d = ShardedBatches(dataset(), 8, shuffle=True, seed=3)
    whole = dropout_model()
    opt = torch.optim.Adam(whole.parameters(), lr=0.01)
    ckpt = Checkpoint(tmp_path / "run.ckpt")
    with gradagg.Aggregator(whole, shard_of(whole, d), workers=2) as agg:
        for _ in range(STEPS):
            opt.zero_grad()
            agg.step()
            opt.step()
            if agg.steps_done == SAVED_AT:
                ckpt.save(whole, opt, step=agg.steps_done, position=agg.position)

    model = dropout_model()  # the same torch seed as the run that saved
    model_opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with gradagg.Aggregator(model, shard_of(model, d), workers=2) as agg:
        for _ in range(5):  # steps that the load undoes
            agg.step()
            model_opt.step()
        assert agg.steps_done == 5
        ckpt.load(model, model_opt)
        for step in range(SAVED_AT, STEPS):
            model_opt.zero_grad()
            assert agg.step().step == step
            model_opt.step()
        assert agg.steps_done == STEPS
    assert same_parameters(model, whole)


# -- b: steps at positions read ShardedBatches' batches ---------------------------------------

def test_leaving_an_epoch_early_does_not_shift_the_next_one():
    d = ShardedBatches(dataset(), 4, shuffle=True, seed=3)  # 5 steps per epoch
    model = dropout_model().eval()  # no dropout: a one-process reference at 1e-12
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    read = []
    with gradagg.Aggregator(model, shard_of(model, d), workers=2) as agg:
        for epoch in range(2):
            for i, position in enumerate(d.steps(epoch)):
                if epoch == 0 and i == 2:
                    break  # as a loop that leaves an epoch on a condition
                opt.zero_grad()
                report = agg.step(position)
                opt.step()
                read.append((position, report.metrics["ids"]))
                assert agg.position == position.next()
        assert agg.steps_done == 7 and agg.position == BatchPosition(1, 5)
        with pytest.raises(gradagg.InvalidArgument, match="a batch is trained once"):
            agg.step(BatchPosition(1, 4))

    trained = [BatchPosition(0, 0), BatchPosition(0, 1)] + d.steps(1)
    assert [p for p, _ in read] == trained
    # The workers read epoch 1's batches, not epoch 0's batches 2.. that step() counts on to.
    assert [ids for _, ids in read] == [sum(d.indices(p)) for p in trained]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for position in trained:
        x, y, _ = d.global_batch(position)
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_steps_of_an_epoch_from_a_position_and_the_position_rule():
    d = ShardedBatches(dataset(10), 4)  # 3 steps per epoch: 4, 4, 2
    assert d.steps(1) == [BatchPosition(1, i) for i in range(3)]
    assert d.steps(1, BatchPosition(0, 2)) == d.steps(1)           # an earlier epoch: all
    assert d.steps(1, BatchPosition(1, 1)) == [BatchPosition(1, 1), BatchPosition(1, 2)]
    assert d.steps(1, BatchPosition(1, 3)) == []                   # the epoch is done
    assert d.steps(1, BatchPosition(2, 0)) == []                   # a later epoch: none
    assert d.position_of(4) == BatchPosition(1, 1)
    assert d.indices(BatchPosition(1, 1), 1, 2) == d.indices(4, 1, 2)
    assert d.global_batch(BatchPosition(0, 2))[2].tolist() == [8.0, 9.0]
    with pytest.raises(gradagg.InvalidArgument, match="batch 3 of epoch 0: expected"):
        d.indices(BatchPosition(0, 3))
    with pytest.raises(gradagg.InvalidArgument, match="start: expected a gradagg.BatchPosition"):
        d.steps(0, (0, 1))


def test_batch_position_is_a_value():
    import pickle
    p = BatchPosition(1, 2)
    assert (p.epoch, p.index, repr(p)) == (1, 2, "BatchPosition(epoch=1, index=2)")
    assert p.next() == BatchPosition(1, 3) and p == BatchPosition(epoch=1, index=2)
    assert BatchPosition(0, 9) < p <= p and not p < p and p != BatchPosition(2, 0)
    assert BatchPosition() == BatchPosition(0, 0) and p != (1, 2)
    assert len({p, BatchPosition(1, 2), BatchPosition(2, 1)}) == 2
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(AttributeError):  # a value, hashable: read-only
        p.index = 5


# -- c: a per-epoch scheduler resumes from any step ---------------------------------------------

EPOCHS = 3


def mnist_structure(seed):
    model = dropout_model(seed)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def train_epochs(model, opt, sched, d, state, save_to=None):
    """The Fashion-MNIST example's loop: epochs of positions, StepLR after each epoch, a
    checkpoint after every step (before an epoch's scheduler step)."""
    with gradagg.Aggregator(model, shard_of(model, d), workers=2) as agg:
        assert agg.steps_done == state.step and agg.position == state.position
        for epoch in range(state.position.epoch, EPOCHS):
            for position in d.steps(epoch, state.position):
                opt.zero_grad()
                agg.step(position)
                opt.step()
                if save_to is not None:
                    Checkpoint(save_to / f"{agg.steps_done}.ckpt").save(
                        model, opt, step=agg.steps_done, position=agg.position, scheduler=sched)
            sched.step()


# A resume from an epoch's last step steps the scheduler before the fresh optimizer's first
# step (torch keeps that count out of the state_dict): its warning says nothing here.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_per_epoch_scheduler_resumed_from_every_step_is_the_run_never_stopped(tmp_path):
    d = ShardedBatches(dataset(12), 4, shuffle=True, seed=3)  # 3 steps per epoch
    whole, opt, sched = mnist_structure(7)
    train_epochs(whole, opt, sched, d, gradagg.TrainingState(), save_to=tmp_path)
    steps = EPOCHS * d.steps_per_epoch()
    assert sorted(int(f.split(".")[0]) for f in os.listdir(tmp_path) if f.endswith(".ckpt")) \
        == list(range(1, steps + 1))
    for saved in range(1, steps):
        model, opt, sched = mnist_structure(100 + saved)
        torch.manual_seed(saved)  # the load restores the run's generator, and with it its seed
        state = Checkpoint(tmp_path / f"{saved}.ckpt", read_only=True).load(model, opt,
                                                                          scheduler=sched)
        assert state.step == saved
        assert state.position == BatchPosition((saved - 1) // 3, (saved - 1) % 3 + 1)
        train_epochs(model, opt, sched, d, state)
        assert same_parameters(model, whole), f"resumed from step {saved}"
        assert sched.get_last_lr() == pytest.approx([0.7 ** EPOCHS], rel=1e-12)


# -- d: the workers' seeds follow torch --------------------------------------------------------

def first_gradients(torch_seed, x, y):
    model = dropout_model()
    torch.manual_seed(torch_seed)
    reference = copy.deepcopy(model)

    def shard(ctx):
        part = slice(ctx.rank * 6, ctx.rank * 6 + 6 + 2 * ctx.rank)  # 6 and 8 rows
        return F.mse_loss(model(x[part]), y[part]), len(x[part])

    with gradagg.Aggregator(model, shard, workers=2) as agg:
        agg.step()
    return [p.grad.clone() for p in model.parameters()], reference


def test_the_workers_seeds_follow_torch_manual_seed():
    x, y, _ = dataset(14).tensors
    one, reference = first_gradients(1, x, y)
    again, _ = first_gradients(1, x, y)
    other, _ = first_gradients(2, x, y)
    assert all(torch.equal(a, b) for a, b in zip(one, again))
    assert not any(torch.equal(a, b) for a, b in zip(one, other))  # the dropout masks differ

    # One process: worker r seeds with worker_seed(torch.initial_seed(), r, step) first.
    assert torch.initial_seed() == 2
    torch.manual_seed(1)
    seed, total = torch.initial_seed(), [torch.zeros_like(p) for p in reference.parameters()]
    for rank, part in enumerate((slice(0, 6), slice(6, 14))):
        torch.manual_seed(gradagg.worker_seed(seed, rank, 0))
        reference.zero_grad()
        F.mse_loss(reference(x[part]), y[part]).backward()
        rows = part.stop - part.start
        total = [t + p.grad * rows for t, p in zip(total, reference.parameters())]
    for got, want in zip(one, total):
        torch.testing.assert_close(got, want / 14, rtol=0, atol=1e-12)


def test_worker_seed_and_the_seed_option():
    assert gradagg.worker_seed(5, 1, 2) == gradagg.worker_seed(5, 1, 2)
    assert len({gradagg.worker_seed(5, r, s) for r in range(3) for s in range(3)}) == 9
    assert 0 <= gradagg.worker_seed(2**64 - 1, 255, 10**12) < 2**64
    with pytest.raises(gradagg.InvalidArgument, match="seed: expected an int in"):
        gradagg.worker_seed(-1, 0, 0)
    assert gradagg.Options().seed is None and gradagg.Options(seed=3).seed == 3
    for bad in (-1, 2**64, 1.5):
        with pytest.raises(gradagg.InvalidArgument, match="seed: expected None or an int"):
            gradagg.Options(seed=bad)


# -- e: the writer thread ----------------------------------------------------------------------

FAILED_WRITE = """
import os, resource, sys, torch
from gradagg import Checkpoint, CheckpointError
path = sys.argv[1]
torch.manual_seed(3)
model = torch.nn.Linear(256, 256)
ckpt = Checkpoint(path)
ckpt.save(model, step=1)
ckpt.wait()
good = ckpt.identity()
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) // 2,) * 2)

def expect_failure(what, call):
    try:
        call()
    except CheckpointError as e:
        if "File too large" not in str(e) or e.path != path:
            sys.exit(f"{what}: unexpected error {e!r}")
        return str(e)
    sys.exit(f"{what} did not raise the write's failure")

ckpt.save(model, step=2)          # returns: the writer thread fails
if not ckpt.exists():             # waits, keeps the failure for wait()
    sys.exit("the previous file is gone")
if "saving step 2" not in expect_failure("wait()", ckpt.wait):
    sys.exit("the failure does not name its step")
ckpt.wait()                       # raised once
ckpt.save(model, step=3)
if "saving step 3" not in expect_failure("the next save()", lambda: ckpt.save(model, step=4)):
    sys.exit("the next save() raised another failure")
ckpt.wait()                       # step 4 was never started
ckpt.save(model, step=5)
expect_failure("load()", lambda: ckpt.load(model))
if ckpt.identity() != good or ckpt.load(model).step != 1:
    sys.exit("the previous checkpoint changed")
left = sorted(f for f in os.listdir(os.path.dirname(path))
              if f not in (os.path.basename(path), os.path.basename(path) + ".lock"))
if left:
    sys.exit(f"left behind: {left}")
print("ok")
"""


def test_a_failed_write_is_raised_by_the_next_wait_save_or_load(tmp_path):
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(FAILED_WRITE),
                        str(tmp_path / "run.ckpt")], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_save_keeps_what_it_was_given_while_training_goes_on(tmp_path):
    model = torch.nn.Linear(300, 300)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpoint(tmp_path / "run.ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(model, opt, step=1, position=BatchPosition(2, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # right after save() returned
    other = torch.nn.Linear(300, 300)
    state = ckpt.load(other)  # waits for the write
    assert state.position == BatchPosition(2, 3)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(gradagg.InvalidArgument, match="position: expected a gradagg.Batch"):
        ckpt.save(model, step=1, position=(2, 3))


# -- f: every worker computed the same gradient ---------------------------------------------

def test_workers_that_all_read_the_same_batch_are_reported_once(capfd):
    x, y, _ = dataset(16).tensors
    model = dropout_model().eval()

    def same(ctx):  # ignores ctx: every worker reads the same rows
        return F.mse_loss(model(x[:8]), y[:8]), 8

    def parts(ctx):
        rows = slice(ctx.rank * 8, ctx.rank * 8 + 8)
        return F.mse_loss(model(x[rows]), y[rows]), 8

    with gradagg.Aggregator(model, parts, workers=2) as agg:
        for _ in range(3):
            agg.step()
    assert "every worker's gradient was the same" not in capfd.readouterr().err
    with gradagg.Aggregator(model, same, workers=2) as agg:
        for _ in range(3):
            agg.step()
    err = capfd.readouterr().err
    assert err.count("every worker's gradient was the same") == 1, err
    assert "in step 0" in err and "gradagg.data.ShardedBatches" in err


# -- g: a DataLoader with processes in the shard function ------------------------------------

@pytest.mark.parametrize("made_in", ["parent", "shard function"])
def test_a_dataloader_with_processes_in_the_shard_function_is_refused_at_once(made_in):
    d = dataset(16)
    model = dropout_model().eval()
    parent_loader = DataLoader(d, batch_size=4, num_workers=2)

    def shard(ctx):
        loader = parent_loader if made_in == "parent" else DataLoader(d, batch_size=4,
                                                                      num_workers=2)
        for x, y, _ in loader:
            return F.mse_loss(model(x), y), len(x)

    begin = time.monotonic()
    with gradagg.Aggregator(model, shard, workers=2) as agg:
        with pytest.raises(gradagg.WorkerFailed) as e:
            agg.step()
        assert time.monotonic() - begin < 5
        assert "InvalidArgument" in e.value.worker_message
        for text in ("DataLoader with worker processes (num_workers=2) was iterated inside the "
                     "shard function", "gradagg.data.ShardedBatches", "num_workers=0"):
            assert text in str(e.value), str(e.value)
        # The parent's own loaders are left alone, also while the aggregator lives.
        assert sum(len(x) for x, _, _ in parent_loader) == 16
        parent_iterator = iter(DataLoader(d, batch_size=4, num_workers=2))
        next(parent_iterator)

    def from_the_parent(ctx):  # an iterator made in the parent, advanced in a worker
        x, y, _ = next(parent_iterator)
        return F.mse_loss(model(x), y), len(x)

    try:
        with gradagg.Aggregator(model, from_the_parent, workers=2) as agg:
            with pytest.raises(gradagg.WorkerFailed, match="num_workers=2"):
                agg.step()
    finally:
        parent_iterator._shutdown_workers()


# -- h: StopSignals --------------------------------------------------------------------------

STOPPED_RUN = """
import signal, sys, time, torch, gradagg
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if ignored
path = sys.argv[1]
torch.manual_seed(3)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 4), torch.randn(8, 2)

def shard(ctx):
    time.sleep(0.05)  # a step long enough for the signal to come in the middle of one
    rows = slice(ctx.rank * 4, ctx.rank * 4 + 4)
    return torch.nn.functional.mse_loss(model(x[rows]), y[rows]), 4

ckpt = gradagg.Checkpoint(path)
with gradagg.StopSignals() as stop, gradagg.Aggregator(model, shard, workers=2) as agg:
    while not stop.requested:
        opt.zero_grad()
        agg.step()
        opt.step()
        print(f"step {agg.steps_done}", flush=True)
    with stop.hold():
        ckpt.save(model, opt, step=agg.steps_done)
        ckpt.wait()
    print(f"stopped {agg.steps_done}", flush=True)
    sys.exit(128 + stop.signal)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_the_step_and_writes_the_stop_checkpoint(tmp_path, signum):
    path = tmp_path / "stop.ckpt"
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STOPPED_RUN), str(path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not lines or lines[-1] != "step 3":
            line = p.stdout.readline()
            assert line, p.stderr.read()
            lines.append(line.strip())
        p.send_signal(signum)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    lines += out.strip().splitlines()
    assert p.returncode == 128 + signum, (p.returncode, lines, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = [line for line in lines if line.startswith("step ")][-1]
    assert lines[-1] == "stopped " + last.split()[1], lines
    model = torch.nn.Linear(4, 2)
    assert Checkpoint(path, read_only=True).load(model).step == int(last.split()[1])


def test_stop_signals_in_this_process():
    with gradagg.StopSignals(patience=0.5) as stop:
        assert (stop.requested, stop.signal) == (False, 0)
        with pytest.raises(gradagg.InvalidArgument, match="another StopSignals"):
            gradagg.StopSignals()
        os.kill(os.getpid(), signal.SIGTERM)  # a request, not the end of the process
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (stop.requested, stop.signal) == (True, signal.SIGTERM)
        with stop.hold():
            pass
        assert "requested=True" in repr(stop)
    assert repr(stop) == "gradagg.StopSignals(closed)"
    with pytest.raises(gradagg.NotUsable):
        stop.requested
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(
        gradagg.InvalidArgument, gradagg.StopSignals)))
    thread.start()
    thread.join()
    assert "main thread" in str(errors[0].value)
    with gradagg.StopSignals():  # the first one put its handlers back and let go
        pass
