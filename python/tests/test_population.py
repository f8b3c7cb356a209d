"""gradagg.Population (population-based training) against plain single-process torch.

Members without a policy train as plain torch does, bit for bit; a copy takes the donor's
weights and, as asked, its optimizer state and hyperparameters, then explores; every copy is
one lineage line; a checkpoint resumes as if never stopped; a failing or dying member is a
typed error naming it; the Python example prints what the C++ one prints.
"""
import copy
import json
import os
import re
import subprocess
import time
import sys

import pytest
import torch
import torch.nn.functional as F

import gradagg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "python", "examples", "population_softmax.py")
DATA_DIR = "/usr/share/datasets/fashion-mnist"
PYTHONPATH = os.pathsep.join(p for p in sys.path if p)
K = 3  # publish_interval: train steps per generation


def linear(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


def batch(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


DATA = [batch(11), batch(12), batch(13)]  # member r's fixed data: DATA[r]
POOL_X, POOL_Y = batch(21, n=32)          # batches chosen by ctx.rng (checkpoint test)
VAL_X, VAL_Y = batch(22, n=16)


def sgd_step(model, opt, x, y):
    opt.zero_grad()  # zeroes (torch 1.13's default), as LibTorch 1.13's zero_grad
    F.mse_loss(model(x), y).backward()
    opt.step()


def loss_of(model, x, y):
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def population(model, lrs, *, momentum=0.0, train_step=None, score=None, **options):
    """A population of len(lrs) members of `model`, member r at lr lrs[r], training on DATA[r]."""
    def fixed_step(ctx):
        sgd_step(model, ctx.optimizer, *DATA[ctx.rank])

    def own_loss(ctx):
        return loss_of(model, *DATA[ctx.rank])

    options = {"workers": len(lrs), "publish_interval": K, "threads_per_worker": 1,
               "step_timeout": 60.0, **options}
    return gradagg.Population(
        model,
        make_optimizer=lambda hp: torch.optim.SGD(model.parameters(), lr=hp["lr"],
                                                  momentum=momentum),
        hyperparams=lambda rank, rng: {"lr": lrs[rank]},
        train_step=train_step or fixed_step, score=score or own_loss, **options)


def plain(start, lr, steps, x, y, momentum=0.0):
    """The independent reference: a copy of `start` trained by plain torch in this process."""
    ref = copy.deepcopy(start)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    for _ in range(steps):
        sgd_step(ref, opt, x, y)
    return ref


def same_state(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
                                      for k in a)


def rank1_copies_rank0(at_step=None):
    def policy(inp, rng):
        return 0 if inp.rank == 1 and (at_step is None or inp.step == at_step) else -1
    return policy


# -- training and exploit ------------------------------------------------------------------


def test_policy_none_members_train_as_plain_torch():
    model = linear()
    start = copy.deepcopy(model)
    lrs = [0.1, 0.03, 0.3]
    generations = 3
    with population(model, lrs, policy=gradagg.Policy.none()) as pop:
        assert pop.workers == 3 and list(pop.hyperparam_names) == ["lr"]
        assert pop.policy_name == "none"
        assert len(set(pop.worker_pids)) == 3
        for _ in range(generations):
            assert pop.generation() == []
        for r, lr in enumerate(lrs):
            ref = plain(start, lr, generations * K, *DATA[r])
            assert same_state(pop.state_dict(r), ref.state_dict()), f"member {r}"
            s = pop.snapshot(r)
            assert (s.rank, s.step, s.version, s.last_copy_step) == (r, generations * K,
                                                                   generations + 1, -1)
            assert s.hyperparams == {"lr": lr}
            assert s.score == loss_of(ref, *DATA[r])
            assert all(torch.equal(p, q) for p, q in zip(s.parameters, ref.parameters()))
    # The parent's model is not trained: each member trained its own copy.
    assert same_state(model.state_dict(), start.state_dict())


def test_two_python_threads_sharing_a_population_take_turns():
    # The population's channel carries one command at a time: a second thread's
    # generation() waits for the first, as Aggregator.step() does, and no command is
    # lost or doubled (a race: a StepTimeout, a wrong step count or a hang).
    import threading
    model = linear()
    start = copy.deepcopy(model)
    lrs = [0.1, 0.03]
    per_thread = 6
    errors = []

    def run(pop):
        try:
            for _ in range(per_thread):
                pop.generation()
                pop.snapshot(0)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    with population(model, lrs, step_timeout=10.0) as pop:
        threads = [threading.Thread(target=run, args=(pop,), daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a thread hangs"
        assert errors == []
        for r, lr in enumerate(lrs):
            s = pop.snapshot(r)
            assert (s.step, s.version) == (2 * per_thread * K, 2 * per_thread + 1)
            ref = plain(start, lr, 2 * per_thread * K, *DATA[r])
            assert all(torch.equal(p, q) for p, q in zip(s.parameters, ref.parameters()))


@pytest.mark.parametrize("copy_state", [True, False])
def test_exploit_copies_weights_optimizer_state_and_hyperparams(copy_state):
    model = linear()
    start = copy.deepcopy(model)
    # Both members train on the same data; member 1 (lr 0.02) copies member 0 (lr 0.1)
    # once, after generation 1. With momentum 0.9 the updates after the copy depend on
    # the momentum buffer: only with it copied do the two members stay identical.
    with population(model, [0.1, 0.02], momentum=0.9, policy=rank1_copies_rank0(at_step=K),
                    train_step=lambda ctx: sgd_step(model, ctx.optimizer, *DATA[0]),
                    score=lambda ctx: loss_of(model, *DATA[0]), explore="none",
                    copy_optimizer_state=copy_state, copy_hyperparams=True) as pop:
        assert pop.policy_name in ("custom", "policy")  # a callable: custom (or its __name__)
        events = pop.generation()
        assert len(events) == 1
        e = events[0]
        donor = pop.snapshot(0)
        assert (e.step, e.worker, e.donor, e.donor_version) == (K, 1, 0, donor.version)
        assert e.before == {"lr": 0.02} and e.after == {"lr": 0.1}
        assert e.donor_score == donor.score == loss_of(plain(start, 0.1, K, *DATA[0], 0.9),
                                                       *DATA[0])
        assert e.score == loss_of(plain(start, 0.02, K, *DATA[0], 0.9), *DATA[0])
        s1 = pop.snapshot(1)
        assert s1.last_copy_step == K and s1.hyperparams == {"lr": 0.1}
        assert s1.score == donor.score
        assert all(torch.equal(p, q) for p, q in zip(s1.parameters, donor.parameters))
        assert len(s1.optimizer_state) > 0
        assert pop.generation() == []
        same = same_state(pop.state_dict(1), pop.state_dict(0))
    assert same == copy_state


def test_explore_perturbs_the_copied_hyperparams_and_writes_the_lineage(tmp_path):
    lineage = tmp_path / "lineage.jsonl"
    model = linear()
    policy = gradagg.Policy.custom("rank 1 copies rank 0", rank1_copies_rank0())
    events = []
    with population(model, [0.1, 0.02], policy=policy, explore="perturb",
                    lineage_path=str(lineage)) as pop:
        assert pop.policy_name == "rank 1 copies rank 0"
        for _ in range(2):
            donor_lr = pop.snapshot(0).hyperparams["lr"]
            got = pop.generation()
            assert [(e.worker, e.donor) for e in got] == [(1, 0)]
            e = got[0]
            assert any(e.after["lr"] == pytest.approx(donor_lr * f, rel=1e-12)
                       for f in (0.8, 1.2)), (donor_lr, e.after)
            assert pop.snapshot(1).hyperparams == e.after
            assert pop.snapshot(0).hyperparams == {"lr": 0.1}
            events += got
    assert events[1].before == events[0].after
    lines = [json.loads(line) for line in lineage.read_text().splitlines()]
    assert len(lines) == len(events) == 2
    for line, e in zip(lines, events):
        assert set(line) == {"step", "worker", "donor", "donor_version", "score", "donor_score",
                             "hyperparams_before", "hyperparams_after"}
        assert (line["step"], line["worker"], line["donor"], line["donor_version"]) == (
            e.step, e.worker, e.donor, e.donor_version)
        assert (line["score"], line["donor_score"]) == (e.score, e.donor_score)
        assert line["hyperparams_before"] == e.before
        assert line["hyperparams_after"] == e.after
    assert [line["step"] for line in lines] == [K, 2 * K]


# -- checkpoint and resume -------------------------------------------------------------------


def pbt_population(model, **options):
    """3 members, momentum SGD, batches drawn by ctx.rng, truncation with perturb."""
    def train_step(ctx):
        start = ctx.rng.below(len(POOL_X) - 8)
        sgd_step(model, ctx.optimizer, POOL_X[start:start + 8], POOL_Y[start:start + 8])

    return population(model, [0.2, 0.01, 0.05], momentum=0.9, train_step=train_step,
                      score=lambda ctx: loss_of(model, VAL_X, VAL_Y), seed=5,
                      policy=gradagg.Policy.truncation(0.34), **options)


def outcome(pop):
    return [(pop.state_dict(r), pop.snapshot(r)) for r in range(pop.workers)]


def event_tuples(events):
    return [(e.step, e.worker, e.donor, e.donor_version, e.score, e.donor_score, e.before,
             e.after) for e in events]


def test_a_resumed_population_is_the_one_never_stopped(tmp_path):
    generations, first = 4, 2
    with pbt_population(linear()) as pop:
        events = [event_tuples(pop.generation()) for _ in range(generations)]
        whole = outcome(pop)
    assert sum(map(len, events)) > 0  # something was copied
    path = str(tmp_path / "pop.ckpt")
    with pbt_population(linear()) as pop:
        for _ in range(first):
            pop.generation()
        pop.checkpoint(path)
    # Other initial weights: a resumed member starts from the checkpoint, not from the model.
    with pbt_population(linear(seed=99), resume_from=path) as pop:
        assert pop.snapshot(0).step == first * K
        resumed_events = [event_tuples(pop.generation()) for _ in range(generations - first)]
        resumed = outcome(pop)
    assert resumed_events == events[first:]
    for r, ((sd, s), (sd2, s2)) in enumerate(zip(whole, resumed)):
        assert same_state(sd, sd2), f"member {r}"
        assert (s.step, s.version, s.last_copy_step, s.score, s.hyperparams) == (
            s2.step, s2.version, s2.last_copy_step, s2.score, s2.hyperparams), f"member {r}"

    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    bad = tmp_path / "corrupt.ckpt"
    bad.write_bytes(bytes(raw))
    with pytest.raises(gradagg.CheckpointError) as e:
        pbt_population(linear(), resume_from=str(bad))
    assert str(bad) in str(e.value)


# -- failures --------------------------------------------------------------------------------


def test_a_member_that_raises_is_worker_failed_then_not_usable():
    model = linear()

    def train_step(ctx):
        if ctx.rank == 1 and ctx.step == 1:
            raise ValueError("boom")
        sgd_step(model, ctx.optimizer, *DATA[ctx.rank])

    with population(model, [0.1, 0.1], train_step=train_step) as pop:
        with pytest.raises(gradagg.WorkerFailed) as e:
            pop.generation()
        assert "boom" in str(e.value)
        assert "population member 1" in str(e.value)
        assert e.value.rank == 1
        assert not pop.usable
        with pytest.raises(gradagg.NotUsable):
            pop.generation()
        assert pop.snapshot(1).step == 0  # the last complete snapshot is still readable


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_member_that_dies(tmp_path, max_restarts):
    model = linear()
    died = tmp_path / "died"

    def train_step(ctx):
        if ctx.rank == 1 and ctx.step == 1 and not died.exists():
            died.touch()  # the restarted member lives
            os._exit(3)
        sgd_step(model, ctx.optimizer, *DATA[ctx.rank])

    with population(model, [0.1, 0.1], train_step=train_step,
                    max_restarts=max_restarts) as pop:
        pids = pop.worker_pids
        if max_restarts == 0:
            with pytest.raises(gradagg.WorkerDied) as e:
                pop.generation()
            assert e.value.rank == 1 and "population member 1" in str(e.value)
            with pytest.raises(gradagg.NotUsable):
                pop.generation()
        else:
            pop.generation()
            assert pop.restarts == 1 and pop.usable
            assert pop.worker_pids[0] == pids[0] and pop.worker_pids[1] != pids[1]
            pop.generation()
            assert pop.snapshot(0).step == 2 * K
    assert died.exists()


# -- bad input -------------------------------------------------------------------------------


def fns(model):
    return {"make_optimizer": lambda hp: torch.optim.SGD(model.parameters(), lr=hp["lr"]),
            "hyperparams": lambda rank, rng: {"lr": 0.1},
            "train_step": lambda ctx: sgd_step(model, ctx.optimizer, *DATA[0]),
            "score": lambda ctx: 0.0}


def test_bad_input_is_invalid_argument_at_construction():
    model = linear()
    no_optimizer = {k: v for k, v in fns(model).items() if k != "make_optimizer"}
    with pytest.raises((gradagg.InvalidArgument, TypeError)):
        gradagg.Population(model, workers=2, **no_optimizer)
    with pytest.raises((gradagg.InvalidArgument, TypeError)):
        gradagg.Population(model, workers=2, **{**fns(model), "make_optimizer": 42})
    with pytest.raises(gradagg.InvalidArgument) as e:
        gradagg.Population(model, workers=0, **fns(model))
    assert "workers" in str(e.value)
    names = {**fns(model), "hyperparams": lambda rank, rng: {"lr" if rank == 0 else "eta": 0.1}}
    with pytest.raises(gradagg.InvalidArgument) as e:
        gradagg.Population(model, workers=2, **names)
    assert "rank 1" in str(e.value)


# -- the example -----------------------------------------------------------------------------


def run(*command):
    return subprocess.run(list(command), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=PYTHONPATH))


def cpp_example():
    build = os.environ.get("GRADAGG_BUILD_DIR", os.path.join(ROOT, "build"))
    path = os.path.join(build, "examples", "population_softmax")
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} not built")
    return path


@pytest.mark.skipif(not os.path.isdir(DATA_DIR), reason=f"{DATA_DIR} missing "
                    "(dataset-fashion-mnist)")
def test_the_python_example_prints_what_the_cpp_example_prints():
    flags = ["--steps", "200", "--interval", "50", "--seed", "1", "--policy", "truncation"]
    cpp = run(cpp_example(), *flags)
    assert cpp.returncode == 0, cpp.stdout + cpp.stderr
    py = run(sys.executable, EXAMPLE, *flags)
    assert py.returncode == 0, py.stdout + py.stderr
    assert py.stdout == cpp.stdout
    assert py.stdout.startswith("policy truncation(0.25), 4 workers, 200 steps each")


def test_the_python_example_without_data_exits_as_the_cpp_one(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    py = run(sys.executable, EXAMPLE, "--data", nowhere)
    assert f"{nowhere}/train-images-idx3-ubyte.gz" in py.stderr
    assert "Traceback" not in py.stderr and len(py.stderr.splitlines()) == 1
    assert py.returncode == 2  # bad input (docs/errors.md), as the C++ example
    cpp = run(cpp_example(), "--data", nowhere)
    assert (py.returncode, py.stderr) == (cpp.returncode, cpp.stderr)


@pytest.mark.skipif(not os.path.isdir(DATA_DIR), reason=f"{DATA_DIR} missing "
                    "(dataset-fashion-mnist)")
@pytest.mark.parametrize("example", ["cpp", "python"])
def test_checkpoint_every_survives_kill_9_and_resumes_to_the_same_result(tmp_path, example):
    command = [cpp_example()] if example == "cpp" else [sys.executable, EXAMPLE]
    flags = ["--steps", "300", "--interval", "50", "--seed", "2", "--policy", "truncation",
             "--workers", "2"]
    whole = run(*command, *flags)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    # A run killed with SIGKILL (no handler runs) after its first periodic checkpoint.
    path = tmp_path / "pop.ckpt"
    killed = subprocess.Popen([*command, *flags, "--checkpoint", str(path),
                               "--checkpoint-every", "100"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    try:
        for _ in range(1200):
            if path.exists() or killed.poll() is not None:
                break
            time.sleep(0.05)
        assert path.exists(), "no periodic checkpoint was written"
    finally:
        killed.kill()
        killed.wait(timeout=30)
    # Resumed from whatever checkpoint it left, the run ends as the one never stopped
    # (every member's accuracy and lr; the copies counted are this process's only).
    resumed = run(*command, *flags, "--resume", str(path))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    def without_copies(out):
        return re.sub(r", \d+ copies$", "", out, flags=re.M)
    assert without_copies(resumed.stdout) == without_copies(whole.stdout)
    assert len(resumed.stdout.splitlines()) == 4
