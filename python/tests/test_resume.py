"""A run resumed from a gradagg.Checkpoint is the run never stopped, bit for bit:
in a fresh process, with dropout, Adam and StepLR, given start_step=; and the
Fashion-MNIST example stopped mid-epoch and resumed ends as the whole run."""
import io
import os
import shutil
import subprocess
import sys

import pytest
import torch

import gradagg
from gradagg import Checkpoint
from models import bounds, data, mlp, shard_fn

PYTHONPATH = os.pathsep.join(p for p in sys.path if p)
SETTINGS = {"seed": 7, "batch": 24, "data": "models.data(24)"}

# -- a resumed run is the run never stopped --------------------------------------------------

STEPS, RESUME_AT, WORKERS = 20, 10, 2


def dropout_training(seed):
    """A model with Dropout, Adam and StepLR (the lr changes across the resume point)."""
    model = mlp(seed=seed, dropout=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, ckpt, first, last, keep=None):
    """Steps first..last-1 through an Aggregator, a checkpoint after every one; `keep` maps a
    step to a path that gets a copy of that step's checkpoint."""
    x, y = data(24)
    shard = shard_fn(model, x, y, bounds(24, WORKERS, False))
    with gradagg.Aggregator(model, shard, workers=WORKERS, start_step=first) as agg:
        for step in range(first, last):
            opt.zero_grad()
            report = agg.step()
            assert report.step == step, (report.step, step)
            opt.step()
            sched.step()
            ckpt.save(model, opt, step=step + 1, scheduler=sched, settings=SETTINGS,
                      user={"loss": report.loss})
            if keep and step + 1 in keep:
                ckpt.wait()  # the writer thread's file is in place
                shutil.copyfile(ckpt.path, keep[step + 1])


def resume(resume_from, save_to, out):
    """In a fresh process: another initialisation, then the checkpoint, then to STEPS."""
    model, opt, sched = dropout_training(seed=1234)
    torch.manual_seed(999)
    state = Checkpoint(resume_from, read_only=True).load(model, opt, scheduler=sched,
                                                          settings=SETTINGS)
    assert state.step == RESUME_AT, state.step
    train(model, opt, sched, Checkpoint(save_to), state.step, STEPS)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out)


RESUME = """
import sys
from test_resume import resume
resume(*sys.argv[1:])
"""


def test_a_run_resumed_in_a_fresh_process_is_the_run_never_stopped_bit_for_bit(tmp_path):
    model, opt, sched = dropout_training(seed=7)
    at_resume = tmp_path / f"step{RESUME_AT}.ckpt"
    train(model, opt, sched, Checkpoint(tmp_path / "run.ckpt"), 0, STEPS,
          keep={RESUME_AT: at_resume})
    assert Checkpoint(tmp_path / "run.ckpt").load(dropout_training(1)[0],
                                                  settings=SETTINGS).step == STEPS

    out = tmp_path / "resumed.pt"
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    r = subprocess.run([sys.executable, "-c", RESUME, str(at_resume),
                        str(tmp_path / "resumed.ckpt"), str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = torch.load(out)
    mine = model.state_dict()
    assert list(resumed["model"]) == list(mine)
    for name, tensor in mine.items():
        assert torch.equal(resumed["model"][name], tensor), name
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(resumed["optimizer"]["state"][index][key]),
                               torch.as_tensor(value)), (index, key)
    assert resumed["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]  # StepLR's lr

    # The resumed half trained: step 10's parameters are not step 20's.
    at_ten = dropout_training(seed=7)[0]
    Checkpoint(at_resume).load(at_ten, settings=SETTINGS)
    assert not any(torch.equal(a, b) for a, b in zip(at_ten.parameters(), model.parameters()))


# -- the example -----------------------------------------------------------------------------

FASHION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "fashion_mnist.py")
FASHION_DATA = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isdir(FASHION_DATA), reason=f"{FASHION_DATA} missing")
def test_the_fashion_example_stopped_and_resumed_ends_as_the_run_never_stopped(tmp_path):
    def fashion(*args):
        env = dict(os.environ, PYTHONPATH=PYTHONPATH)
        r = subprocess.run([sys.executable, FASHION, "--epochs", "2", "--limit", "1500",
                            "--workers", "2", *args], capture_output=True, text=True,
                           timeout=300, env=env)
        return r.returncode, r.stdout, r.stderr

    rc, whole, err = fashion("--checkpoint", str(tmp_path / "whole.ckpt"))
    assert rc == 0, whole + err
    ckpt = str(tmp_path / "run.ckpt")
    rc, out, err = fashion("--checkpoint", ckpt, "--stop-after", "30")  # mid-epoch 2 of 23
    assert rc == 0 and "stopped after step 30" in out, out + err
    rc, out, err = fashion("--checkpoint", ckpt, "--resume", ckpt)
    assert rc == 0 and "resumed from" in out, out + err
    last = [line.split(" (")[0] for line in (whole, out) for line in line.splitlines()
            if line.startswith("epoch 2:")]
    assert len(last) == 2 and last[0] == last[1], (whole, out)  # losses and accuracy, exactly
    ends = [torch.load(io.BytesIO(gradagg._core._read_verified(p)[0]))
            for p in (ckpt, str(tmp_path / "whole.ckpt"))]
    assert ends[0]["step"] == ends[1]["step"] == 46
    assert all(torch.equal(ends[0]["model"][k], v) for k, v in ends[1]["model"].items())
    rc, out, err = fashion("--resume", ckpt, "--batch", "16")
    assert rc != 0 and "was written with batch = 32, this run has batch = 16" in err, out + err
    assert "Traceback" not in err
