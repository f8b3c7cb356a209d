"""Every error is a Python exception class naming the worker, the phase, the parameter."""
import math
import os
import signal
import time

import pytest
import torch

import gradagg
from models import bounds, data, mlp, shard_fn


def test_exception_in_a_worker_carries_rank_and_traceback():
    model = mlp()
    x, y = data(24)
    good = shard_fn(model, x, y, bounds(24, 2, False))

    failed = []  # each worker's own copy

    def broken_shard(ctx):
        if ctx.rank == 1 and ctx.step == 1 and not failed:
            failed.append(ctx.step)
            raise ValueError(f"no data for rank {ctx.rank}")
        return good(ctx)

    with gradagg.Aggregator(model, broken_shard, workers=2) as agg:
        agg.step()
        with pytest.raises(gradagg.WorkerFailed) as info:
            agg.step()
        e = info.value
        assert e.rank == 1
        assert e.phase == "shard function"
        assert "ValueError: no data for rank 1" in str(e)
        assert e.traceback is not None and "broken_shard" in e.traceback
        assert "Traceback (most recent call last)" in e.worker_message
        assert isinstance(e, gradagg.WorkerError) and isinstance(e, gradagg.Error)
        # The workers live on: step 1 is redone and works this time.
        assert agg.usable
        assert agg.step().step == 1


def test_a_long_traceback_keeps_its_end():
    model = mlp()

    def deep(n):
        if n == 0:
            raise RuntimeError("bottom of the stack")
        return deep(n - 1)

    with gradagg.Aggregator(model, lambda ctx: deep(60), workers=1) as agg:
        with pytest.raises(gradagg.WorkerFailed) as info:
            agg.step()
    assert info.value.worker_message.startswith("RuntimeError: bottom of the stack")
    assert info.value.worker_message.rstrip().endswith("RuntimeError: bottom of the stack")


@pytest.mark.parametrize("result,expected", [
    (lambda: 3.0, "float"),
    (lambda: (torch.ones(1, requires_grad=True).sum(), "x"), "tuple"),
])
def test_a_bad_shard_result_names_what_it_got(result, expected):
    model = mlp()
    with gradagg.Aggregator(model, lambda ctx: result(), workers=1) as agg:
        with pytest.raises(gradagg.WorkerFailed, match=f"returned {expected}"):
            agg.step()


def test_non_finite_gradient_names_the_parameter():
    model = mlp()
    x, y = data(24)

    def shard(ctx):
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if ctx.rank == 1:
            loss = loss + model[2].bias.sum() * math.inf * 0 + (model[2].weight * math.nan).sum()
        return loss, 12

    with gradagg.Aggregator(model, shard, workers=2) as agg:
        with pytest.raises(gradagg.NonFiniteGradient) as info:
            agg.step()
        assert info.value.rank == 1
        assert info.value.parameter in ("2.weight", "2.bias", "")
    with gradagg.Aggregator(model, shard, workers=2, non_finite="skip") as agg:
        report = agg.step()
        assert report.skipped and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kwargs,field", [
    ({"workers": 0}, "workers"),
    ({"weighting": "median"}, "weighting"),
    ({"buffers": "all"}, "buffers"),
    ({"non_finite": "ignore"}, "non_finite"),
    ({"step_timeout": -1}, "step_timeout"),
])
def test_bad_options_are_value_errors_naming_the_field(kwargs, field):
    model = mlp()
    with pytest.raises(gradagg.InvalidArgument, match=field) as info:
        gradagg.Aggregator(model, lambda ctx: None, **kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs,message", [
    ({"message_bytes": -1}, r"message_bytes: expected an int in \[0, 2\*\*64\), got -1"),
    ({"message_bytes": 2**64}, r"message_bytes: expected an int in \[0, 2\*\*64\)"),
    ({"accumulation_steps": 2**31}, r"accumulation_steps: expected an int in \[-2\*\*31, 2\*\*31\)"),
    ({"max_restarts": 2**40}, r"max_restarts: expected an int in \[-2\*\*31, 2\*\*31\)"),
])
def test_ints_out_of_their_range_are_value_errors_naming_the_field_and_range(kwargs, message):
    model = mlp()
    with pytest.raises(gradagg.InvalidArgument, match=message) as info:
        gradagg.Aggregator(model, lambda ctx: None, **kwargs)
    assert isinstance(info.value, ValueError)
    with pytest.raises(gradagg.InvalidArgument, match=message):
        gradagg.Options(**kwargs)
    with pytest.raises(TypeError, match="expected an int, got str"):
        gradagg.Options(**{name: "3" for name in kwargs})
    nodes = gradagg.NodeOptions()
    with pytest.raises(gradagg.InvalidArgument, match=r"nodes.bucket_bytes: .*\[0, 2\*\*64\)"):
        nodes.bucket_bytes = -5


def test_a_message_int_out_of_range_is_a_value_error_naming_the_entry():
    model = mlp()
    x, y = data(8)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(8, 1, False)), workers=1) as agg:
        with pytest.raises(gradagg.InvalidArgument,
                           match=r"message 'big': expected an int in \[-2\*\*63, 2\*\*63\), got "
                                 + str(2**70)):
            agg.step({"big": 2**70})
        agg.step({"small": -2**63, "flag": True})  # the range's ends and a bool go through
        assert agg.steps_done == 1


def test_population_ints_out_of_range_are_value_errors():
    model = torch.nn.Linear(2, 1)
    fns = {"make_optimizer": lambda hp: torch.optim.SGD(model.parameters(), lr=hp["lr"]),
           "hyperparams": lambda rank, rng: {"lr": 0.1},
           "train_step": lambda ctx: None, "score": lambda ctx: 0.0}
    for kwargs, name in (({"workers": 2**40}, "workers"), ({"seed": -1}, "seed"),
                         ({"publish_interval": 2**63}, "publish_interval")):
        with pytest.raises(gradagg.InvalidArgument, match=name + ": expected an int in"):
            gradagg.Population(model, **fns, **kwargs)


def test_node_options_compression_takes_its_names_only():
    nodes = gradagg.NodeOptions()
    assert nodes.compression == "none"
    nodes.compression = "bf16"
    assert nodes.compression == "bf16"
    with pytest.raises(gradagg.InvalidArgument, match="NodeOptions.compression.*'none', 'bf16'.*'fp8'"):
        nodes.compression = "fp8"
    assert nodes.compression == "bf16"


def test_bad_models():
    with pytest.raises(gradagg.InvalidArgument, match="expected a torch.nn.Module"):
        gradagg.Aggregator(object(), lambda ctx: None)
    with pytest.raises(gradagg.InvalidArgument, match="float32, float64, bfloat16 or float16"):
        gradagg.Aggregator(mlp().to(torch.complex64), lambda ctx: None)
    with pytest.raises(gradagg.InvalidArgument, match="shard"):
        gradagg.Aggregator(mlp(), "not callable")


def test_an_aggregator_whose_construction_raised_has_a_repr():
    # pytest's long tracebacks call repr() on the frames' locals, self included:
    # one whose __init__ raised (before or inside the C++ constructor) has no
    # C++ Aggregator behind it. Run in a child: before, this crashed Python.
    code = """
import sys, traceback, gradagg, torch
for model in (object(), torch.nn.Linear(2, 2).to(torch.complex64)):
    try:
        gradagg.Aggregator(model, lambda ctx: None)
    except gradagg.InvalidArgument:
        tb = sys.exc_info()[2]
        while tb.tb_next is not None and "self" not in tb.tb_frame.f_locals:
            tb = tb.tb_next
        print(repr(tb.tb_frame.f_locals["self"]))
"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["gradagg.Aggregator(not constructed)"] * 2


@pytest.mark.parametrize("change", [
    lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.zeros(8, 5))),
    lambda m: m.__setitem__(2, torch.nn.Linear(8, 3)),
    lambda m: m[2].register_parameter("extra", torch.nn.Parameter(torch.zeros(1))),
    lambda m: m.append(torch.nn.Linear(3, 3)),
], ids=["parameter", "submodule", "new-parameter", "new-submodule"])
def test_replaced_parameter_is_an_error(change):
    model = mlp()
    x, y = data(24)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        agg.step()
        change(model)
        with pytest.raises(gradagg.InvalidArgument, match="parameter list changed"):
            agg.step()


def test_parameter_data_of_another_shape_is_an_error():
    model = mlp()
    x, y = data(24)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        model[0].bias.data = torch.zeros(3)
        with pytest.raises(gradagg.InvalidArgument, match="0.bias"):
            agg.step()


def test_killed_worker_is_worker_died():
    model = mlp()
    x, y = data(24)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        agg.step()
        os.kill(agg.worker_pids[1], signal.SIGKILL)
        with pytest.raises(gradagg.WorkerDied) as info:
            agg.step()
        assert info.value.rank == 1 and info.value.signal == signal.SIGKILL
        assert not agg.usable
        with pytest.raises(gradagg.NotUsable):
            agg.step()


def test_slow_worker_is_step_timeout():
    model = mlp()
    x, y = data(24)
    good = shard_fn(model, x, y, bounds(24, 2, False))

    def slow(ctx):
        if ctx.rank == 0:
            time.sleep(5)
        return good(ctx)

    with gradagg.Aggregator(model, slow, workers=2, step_timeout=0.5) as agg:
        begin = time.monotonic()
        with pytest.raises(gradagg.StepTimeout) as info:
            agg.step()
        assert time.monotonic() - begin < 3
        assert info.value.rank == 0 and info.value.phase == "shard function"


def test_closed_aggregator_is_not_usable():
    model = mlp()
    x, y = data(24)
    agg = gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2)
    agg.close()
    agg.close()
    with pytest.raises(gradagg.NotUsable):
        agg.step()
