"""Training loops that carry state, from Python: the global step (start_step=),
a message with each step (step(message) -> ctx.message), metrics out
((loss, samples, {...}) -> StepReport.metrics), workers with nothing to do
((None, 0)) and the errors that explain the common mistakes. Gradients are
compared with plain autograd on one process."""
import os
import signal

import pytest
import torch

import gradagg
from models import bounds, data, full_batch_grads, mlp, shard_fn


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def close(a, b, tol=1e-5):
    return all(torch.allclose(s, t, rtol=tol, atol=tol * 1e-2) for s, t in zip(a, b))


# -- the global step ---------------------------------------------------------------------------

def test_the_first_step_is_start_step_and_seeds_follow_it():
    model = mlp()
    x, y = data(8)

    def draw(ctx):
        # What the worker's generator gives in this step, and the step it was told.
        value = torch.rand(1).item()
        return torch.nn.functional.mse_loss(model(x), y), 1, {"step": ctx.step, "draw": value}

    with gradagg.Aggregator(model, draw, workers=2) as agg:
        whole = [agg.step().workers[0].metrics["draw"] for _ in range(4)]
    with gradagg.Aggregator(model, draw, workers=2, start_step=2) as agg:
        assert agg.steps_done == 2
        report = agg.step()
        assert report.step == 2 and report.workers[1].metrics["step"] == 2
        assert report.metrics["step"] == 4
        assert [report.workers[0].metrics["draw"], agg.step().workers[0].metrics["draw"]] == \
            whole[2:]


def test_start_step_is_an_option_for_one_node_and_many():
    assert gradagg.Options().start_step == 0
    assert not hasattr(gradagg.NodeOptions(), "start_step")
    with pytest.raises(gradagg.InvalidArgument, match="start_step"):
        gradagg.Aggregator(mlp(), lambda ctx: None, start_step=-3)


# -- messages ----------------------------------------------------------------------------------

def test_the_parents_sampler_picks_the_rows_through_the_message():
    model = mlp()
    reference = mlp()
    x, y = data(64)

    def shard(ctx):
        rows = ctx.message["rows"].chunk(ctx.workers)[ctx.rank]
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows]) * ctx.message["scale"]
        return loss, len(rows)

    torch.manual_seed(3)
    with gradagg.Aggregator(model, shard, workers=3) as agg:
        for step in range(3):
            rows = torch.randperm(64)[:15]
            agg.step({"rows": rows, "scale": 1.0 + step})
            reference.zero_grad()
            (torch.nn.functional.mse_loss(reference(x[rows]), y[rows]) * (1.0 + step)).backward()
            assert close(grads(model), grads(reference)), step
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters()):
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad


def test_every_value_arrives_as_sent_numbers_as_python_numbers():
    model = mlp()
    x, y = data(8)
    sent = {"f64": torch.randn(3, 4, dtype=torch.float64), "i32": torch.arange(8, dtype=torch.int32),
            "bool": torch.tensor([True, False, True]), "t": torch.arange(12.).reshape(3, 4).t(),
            "epoch": 7, "lr": 0.25, "flag": True}

    def shard(ctx):
        m = ctx.message
        same = (set(m) == set(sent) and type(m["epoch"]) is int and type(m["lr"]) is float
                and m["epoch"] == 7 and m["lr"] == 0.25 and m["flag"] == 1
                and all(torch.equal(m[k], v) and m[k].dtype == v.dtype
                        for k, v in sent.items() if isinstance(v, torch.Tensor)))
        return torch.nn.functional.mse_loss(model(x), y), 1, {"same": same, "n": len(m)}

    with gradagg.Aggregator(model, shard, workers=2) as agg:
        assert agg.step(sent).metrics["same"] == 2
        assert agg.step().metrics["n"] == 0
        assert agg.step(message={"epoch": 1}).metrics["n"] == 2


def test_a_message_that_does_not_fit_is_refused_before_anything_runs():
    model = mlp()
    x, y = data(8)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(8, 2, False)), workers=2,
                            message_bytes=4096) as agg:
        agg.step()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(gradagg.InvalidArgument, match="4096 bytes"):
            agg.step({"big": torch.zeros(4096)})
        with pytest.raises(gradagg.InvalidArgument,
                           match="message 'x': expected a torch.Tensor, int or float, got str"):
            agg.step({"x": "text"})
        with pytest.raises(gradagg.InvalidArgument, match="message"):
            agg.step([1, 2])
        assert agg.steps_done == 1
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        agg.step({"small": torch.zeros(10)})


def test_a_restarted_step_sees_the_same_message(tmp_path):
    model = mlp()
    reference = mlp()
    x, y = data(32)
    marker = tmp_path / "killed"

    def shard(ctx):
        rows = ctx.message["rows"].chunk(ctx.workers)[ctx.rank]
        if ctx.rank == 1 and ctx.step == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.nn.functional.mse_loss(model(x[rows]), y[rows]), len(rows)

    with gradagg.Aggregator(model, shard, workers=2, max_restarts=1) as agg:
        agg.step({"rows": torch.arange(8)})
        report = agg.step({"rows": torch.arange(20, 30)})
        assert report.restarts == 1 and marker.exists()
    torch.nn.functional.mse_loss(reference(x[20:30]), y[20:30]).backward()
    assert close(grads(model), grads(reference))


# -- metrics and empty shards ------------------------------------------------------------------

def test_metrics_are_summed_over_the_workers_and_kept_per_worker():
    model = mlp()
    x, y = data(24)
    b = bounds(24, 3, True)

    def shard(ctx):
        lo, hi = b[ctx.rank], b[ctx.rank + 1]
        out = model(x[lo:hi])
        correct = (out.argmax(1) == y[lo:hi].argmax(1)).sum()
        return torch.nn.functional.mse_loss(out, y[lo:hi]), hi - lo, {"correct": correct,
                                                                        "rows": hi - lo}

    with gradagg.Aggregator(model, shard, workers=3) as agg:
        report = agg.step()
    with torch.no_grad():
        want = (mlp()(x).argmax(1) == y.argmax(1)).sum().item()
    assert report.metrics == {"correct": want, "rows": 24}
    assert [w.metrics["rows"] for w in report.workers] == [b[r + 1] - b[r] for r in range(3)]


def test_other_metric_names_later_are_an_error_and_nothing_is_applied():
    model = mlp()
    x, y = data(8)

    def shard(ctx):
        name = "accuracy" if ctx.step == 1 and ctx.rank == 0 else "correct"
        return torch.nn.functional.mse_loss(model(x), y), 4, {name: 1}

    with gradagg.Aggregator(model, shard, workers=2) as agg:
        agg.step()
        with pytest.raises(gradagg.InvalidArgument, match="'accuracy'.*'correct'"):
            agg.step()
        assert agg.steps_done == 1 and agg.usable


@pytest.mark.parametrize("weighting", ["samples", "equal"])
def test_the_uneven_last_batch_is_the_mean_over_the_rows_that_exist(weighting):
    model = mlp()
    x, y = data(5)
    b = [0, 2, 4, 5, 5]  # 5 rows on 4 workers: the last has none

    def shard(ctx):
        lo, hi = b[ctx.rank], b[ctx.rank + 1]
        if lo == hi:
            return None, 0
        return torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]), hi - lo

    with gradagg.Aggregator(model, shard, workers=4, weighting=weighting) as agg:
        report = agg.step()
    assert report.samples == 5 and report.workers[3].samples == 0
    if weighting == "samples":
        want = full_batch_grads(mlp(), x, y)
    else:  # the mean of the three contributors' losses
        ref = mlp()
        sum(torch.nn.functional.mse_loss(ref(x[lo:hi]), y[lo:hi])
            for lo, hi in [(0, 2), (2, 4), (4, 5)]).div(3).backward()
        want = grads(ref)
    assert close(grads(model), want)


def test_a_step_where_every_worker_is_empty_is_an_invalid_argument():
    with gradagg.Aggregator(mlp(), lambda ctx: (None, 0), workers=2) as agg:
        with pytest.raises(gradagg.InvalidArgument, match="0 samples"):
            agg.step()
        assert agg.usable and agg.steps_done == 0


# -- errors that explain -----------------------------------------------------------------------

def test_a_python_number_as_the_loss_is_told_it_must_be_a_tensor():
    model = mlp()
    x, y = data(8)
    with gradagg.Aggregator(model, lambda ctx: (torch.nn.functional.mse_loss(model(x), y).item(), 8),
                            workers=1) as agg:
        with pytest.raises(gradagg.WorkerFailed, match=r"returned \(float, int\).*torch.Tensor.*"
                                                        r"\.item\(\)"):
            agg.step()


def test_backward_in_the_shard_function_is_told_gradagg_runs_it():
    model = mlp()
    x, y = data(8)

    def shard(ctx):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss, 8

    with gradagg.Aggregator(model, shard, workers=2) as agg:
        with pytest.raises(gradagg.WorkerFailed, match=r"ran backward\(\) itself"):
            agg.step()


def test_every_failed_worker_is_named():
    def shard(ctx):
        if ctx.rank in (0, 2):
            raise ValueError(f"bad record in shard {ctx.rank}")
        return torch.ones(1, requires_grad=True).sum()

    with gradagg.Aggregator(mlp(), shard, workers=3) as agg:
        with pytest.raises(gradagg.WorkerFailed) as info:
            agg.step()
    text = str(info.value)
    assert info.value.rank == 0 and "Traceback" in info.value.worker_message
    assert "worker 2 failed too" in text and "bad record in shard 2" in text
    assert "worker 1 failed" not in text


@pytest.mark.parametrize("text", ["x" * 3000, "\u00e9" * 1500, "a\n" + "\u20ac" * 700])
def test_a_long_or_multibyte_error_text_still_reaches_the_parent(text):
    def shard(ctx):
        raise ValueError(text)

    with gradagg.Aggregator(mlp(), shard, workers=1) as agg:
        with pytest.raises(gradagg.WorkerFailed) as info:
            agg.step()
    message = info.value.worker_message
    first = text.split("\n")[0]
    assert message.startswith("ValueError: " + first[:100]), message[:200]
    assert "\ufffd" not in message  # cut between characters, nothing replaced
    assert message.rstrip().endswith(text[-10:])  # the traceback's end is there too


def test_writing_a_parameter_in_a_worker_names_it():
    model = mlp()
    x, y = data(8)

    def shard(ctx):
        with torch.no_grad():
            model[2].bias.add_(1.0)
        return torch.nn.functional.mse_loss(model(x), y), 8

    with gradagg.Aggregator(model, shard, workers=1) as agg:
        with pytest.raises(gradagg.WorkerDied, match="parameter '2.bias'.*read-only in workers"):
            agg.step()
