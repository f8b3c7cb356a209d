"""gradagg in Python against single-process autograd and against the C++ core."""
import copy
import inspect
import os
import subprocess
import sys

import pytest
import torch

import gradagg
from models import bounds, data, full_batch_grads, mlp, shard_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("GRADAGG_BUILD_DIR", os.path.join(ROOT, "build"))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("unequal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_is_the_full_batch_gradient(workers, unequal, dtype):
    model = mlp(dtype)
    x, y = data(24, dtype)
    want = full_batch_grads(model, x, y)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, workers, unequal)),
                            workers=workers) as agg:
        report = agg.step()
    assert report.samples == 24
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=tol, atol=tol)


def test_equal_weighting_is_the_mean_of_shard_gradients():
    model = mlp()
    x, y = data(24)
    b = bounds(24, 3, unequal=True)
    ref = copy.deepcopy(model)
    loss = sum(torch.nn.functional.mse_loss(ref(x[b[r]:b[r + 1]]), y[b[r]:b[r + 1]])
               for r in range(3)) / 3
    loss.backward()
    with gradagg.Aggregator(model, shard_fn(model, x, y, b), workers=3,
                            weighting="equal") as agg:
        agg.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_matches_one_process_step_for_step(optimizer):
    model = mlp()
    single = copy.deepcopy(model)
    x, y = data(30)

    def make(m):
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(m.parameters(), lr=0.01)

    opt, single_opt = make(model), make(single)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(30, 3, True)), workers=3) as agg:
        for step in range(6):
            single_opt.zero_grad()
            torch.nn.functional.mse_loss(single(x), y).backward()
            single_opt.step()
            opt.zero_grad()
            report = agg.step()
            opt.step()
            assert report.step == step
            for p, q in zip(model.parameters(), single.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # After close the model owns its memory again and still trains on its own.
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_eval_mode_and_buffers_follow_the_parent():
    model = mlp(batchnorm=True)
    x, y = data(24)
    model.eval()
    want = full_batch_grads(model, x, y)  # eval: running statistics, no update
    running_mean = model[1].running_mean.clone()
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        agg.step()
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model[1].running_mean, running_mean)
        model.train()
        agg.step()  # training: worker 0's batch statistics update the running mean
        ref = copy.deepcopy(model)
        assert not torch.equal(model[1].running_mean, running_mean)
    # Worker 0 saw rows 0..11 once: the same update as one process on those rows.
    single = mlp(batchnorm=True)
    single.train()
    single(x[0:12])
    torch.testing.assert_close(ref[1].running_mean, single[1].running_mean)


def test_python_and_cpp_give_the_same_bits():
    """The parity demo in both front ends: the same float32 parameters, bit for bit."""
    cpp = os.path.join(BUILD, "examples", "linear_regression_parity")
    if not os.path.exists(cpp):
        pytest.skip(f"{cpp} is not built")
    script = os.path.join(ROOT, "python", "examples", "linear_regression_parity.py")
    outputs = []
    for cmd in ([cpp, "--workers", "4"], [sys.executable, script, "--workers", "4"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        bits = [line for line in r.stdout.splitlines() if "float32 bits" in line]
        assert len(bits) == 1, r.stdout
        outputs.append(bits[0])
    assert outputs[0] == outputs[1]


def test_torchscript_module():
    eager = mlp()
    model = torch.jit.script(copy.deepcopy(eager))
    x, y = data(24)
    want = full_batch_grads(eager, x, y)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        agg.step()
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)


def test_keyword_options_reach_the_core():
    model = mlp()
    x, y = data(24)
    nodes = gradagg.NodeOptions(nodes=1, timeout=7.5)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 3, False)), workers=3,
                            weighting="equal", buffers="mean", threads_per_worker=1,
                            parent_threads=0, step_timeout=12.5, shutdown_timeout=0.25,
                            non_finite="skip", max_consecutive_skips=4, max_restarts=2,
                            accumulation_steps=3,
                            seed_workers=False, seed=99, check_parameter_list=False,
                            nodes=nodes) as agg:
        o = agg.options
        assert (agg.workers, o.workers, agg.threads_per_worker) == (3, 3, 1)
        assert (o.weighting, o.buffers, o.non_finite) == ("equal", "mean", "skip")
        assert (o.step_timeout, o.shutdown_timeout, o.nodes.timeout) == (12.5, 0.25, 7.5)
        assert (o.parent_threads, o.max_consecutive_skips, o.max_restarts) == (0, 4, 2)
        assert o.accumulation_steps == 3
        assert (o.seed_workers, o.seed, o.check_parameter_list) == (False, 99, False)
        assert "workers=3" in repr(agg)


@pytest.mark.parametrize("cls", [gradagg.Options, gradagg.NodeOptions])
def test_every_option_field_is_a_keyword_and_in_the_repr(cls):
    defaults = cls()
    fields = [n for n in dir(defaults) if not n.startswith("_")
              and not callable(getattr(defaults, n))]
    for name in fields:
        assert f"{name}={getattr(defaults, name)!r}" in repr(defaults)
    assert repr(cls(**{n: getattr(defaults, n) for n in fields})) == repr(defaults)


def test_the_repr_shows_whether_a_job_token_is_set_never_the_token():
    nodes = gradagg.NodeOptions(token="s3cret-token")
    assert nodes.token == "s3cret-token"  # the attribute is the value itself
    options = gradagg.Options(nodes=nodes)
    for text in (repr(nodes), repr(options), str(options)):
        assert "s3cret" not in text and "token='<set>'" in text, text
    assert "token=''" in repr(gradagg.NodeOptions())


def test_the_aggregator_keywords_default_to_the_options_defaults():
    defaults = gradagg.Options()
    parameters = inspect.signature(gradagg.Aggregator.__init__).parameters
    for name in gradagg._OPTION_NAMES:
        assert parameters[name].default == getattr(defaults, name), name


@pytest.mark.parametrize("weighting", ["samples", "equal"])
def test_accumulation_is_the_gradient_of_every_micro_batch(weighting):
    """3 workers x 4 micro-batches of 4, 5 or 6 rows: .grad is what one process
    computes on all 60 rows (by samples), or the mean of the 12 micro-batch
    gradients (equal)."""
    model = mlp()
    x, y = data(60)
    sizes = [4 + i % 3 for i in range(12)]
    starts = [sum(sizes[:i]) for i in range(13)]
    if weighting == "samples":
        want = full_batch_grads(model, x, y)
    else:
        ref = copy.deepcopy(model)
        loss = sum(torch.nn.functional.mse_loss(ref(x[starts[i]:starts[i + 1]]),
                                                y[starts[i]:starts[i + 1]]) for i in range(12))
        (loss / 12).backward()
        want = [p.grad for p in ref.parameters()]

    def shard(ctx):
        i = ctx.rank * ctx.micro_steps + ctx.micro_step
        lo, hi = starts[i], starts[i + 1]
        return torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]), hi - lo

    with gradagg.Aggregator(model, shard, workers=3, accumulation_steps=4,
                            weighting=weighting) as agg:
        report = agg.step()
    assert report.samples == 60
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2)])
def test_bfloat16_model_with_a_float32_layer(dtype, tol):
    """A bf16 MLP with a float32 LayerNorm: .grad within a few bf16 epsilons of
    float64 autograd from the same weights, each parameter in its own dtype."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = model.to(dtype)
    norm = torch.nn.LayerNorm(3)  # float32

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.norm = model, norm

        def forward(self, x):
            return self.norm(self.body(x.to(dtype)).float())

    mixed = Mixed()
    x, y = data(24)
    exact = copy.deepcopy(mixed).double()
    exact.body.to(torch.float64)
    torch.nn.functional.mse_loss(
        exact.norm(exact.body(x.double())), y.double()).backward()
    want = [p.grad for p in exact.parameters()]

    def shard(ctx):
        lo, hi = 12 * ctx.rank, 12 * (ctx.rank + 1)
        return torch.nn.functional.mse_loss(mixed(x[lo:hi]), y[lo:hi]), hi - lo

    with gradagg.Aggregator(mixed, shard, workers=2) as agg:
        agg.step()
    for p, g in zip(mixed.parameters(), want):
        assert p.grad.dtype == p.dtype
        err = (p.grad.double() - g).norm() / g.norm()
        assert err < tol, (p.shape, float(err))
