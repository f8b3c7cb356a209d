"""Python's own traps: the GIL, threads at fork, at-fork handlers, buffered
stdout and atexit in the workers, Ctrl-C during step()."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import gradagg
from models import bounds, data, mlp, shard_fn

PYTHONPATH = os.pathsep.join(p for p in sys.path if p)


def run_python(source, **kwargs):
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(source)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_other_threads_run_while_step_waits():
    model = mlp()
    x, y = data(24)
    good = shard_fn(model, x, y, bounds(24, 2, False))

    def slow(ctx):
        time.sleep(0.3)
        return good(ctx)

    count = [0]
    stop = threading.Event()

    def monitor():  # what a tqdm monitor thread does: wake up, print, sleep
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=monitor)
    thread.start()
    try:
        with gradagg.Aggregator(model, slow, workers=2) as agg:
            before = count[0]
            agg.step()
            during = count[0] - before
    finally:
        stop.set()
        thread.join()
    assert during > 50, f"the monitor thread ran only {during} times in a 0.3 s step"


def test_fork_while_threads_and_a_dataloader_run():
    x, y = data(64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8,
                                         num_workers=2)
    batches = iter(loader)
    next(batches)  # the loader's worker processes and its threads are running
    busy = threading.Event()
    spinning = []

    def spin():  # holds and releases the GIL all the time
        while not busy.is_set():
            spinning.append(sum(range(100)))
            if len(spinning) > 1000:
                spinning.clear()

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        model = mlp()
        with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(64, 2, False)), workers=2,
                                step_timeout=30) as agg:
            for _ in range(5):
                agg.step()
                next(batches)
    finally:
        busy.set()
        thread.join()
    assert sum(1 for _ in batches) == 8 - 1 - 5  # the loader still works
    del batches


def test_workers_run_the_at_fork_child_handlers():
    """PyOS_AfterFork_Child ran in the worker: os.register_at_fork handlers, threading reset."""
    flags = {"child": False}
    os.register_at_fork(after_in_child=lambda: flags.__setitem__("child", True))
    model = mlp()
    x, y = data(24)
    good = shard_fn(model, x, y, bounds(24, 2, False))

    def shard(ctx):
        if not flags["child"]:
            raise RuntimeError("the after_in_child handler did not run")
        t = threading.Thread(target=lambda: None)  # threading works after the fork
        t.start()
        t.join()
        return good(ctx)

    assert not flags["child"]
    with gradagg.Aggregator(model, shard, workers=2) as agg:
        agg.step()
    assert not flags["child"]


def test_stdout_and_atexit_in_workers():
    """Buffered text printed before the fork appears once; workers never run atexit
    handlers; what the workers print is not lost."""
    p = run_python("""
        import atexit, sys, torch, gradagg
        atexit.register(lambda: print("atexit handler ran"))
        print("printed before the fork")           # still in the buffer: stdout is a pipe
        model = torch.nn.Linear(2, 1)
        def shard(ctx):
            # One write per line: atomic on a pipe, so two workers' lines do not mix.
            sys.stdout.write(f"worker {ctx.rank} step {ctx.step}\\n")
            return model(torch.ones(3, 2)).sum(), 3
        with gradagg.Aggregator(model, shard, workers=2) as agg:
            for _ in range(3):
                agg.step()
        print("done")
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines.count("printed before the fork") == 1, out
    assert lines.count("atexit handler ran") == 1, out
    assert lines.count("done") == 1, out
    for r in range(2):
        for s in range(3):
            assert lines.count(f"worker {r} step {s}") == 1, out


def test_ctrl_c_during_step_raises_keyboard_interrupt_and_stops_the_workers():
    p = run_python("""
        import os, sys, time, torch, gradagg
        model = torch.nn.Linear(2, 1)
        def shard(ctx):
            time.sleep(60 if ctx.step == 1 else 0)
            return model(torch.ones(3, 2)).sum(), 3
        agg = gradagg.Aggregator(model, shard, workers=2)
        agg.step()
        pids = agg.worker_pids
        print("pids", *pids, flush=True)
        try:
            agg.step()
            print("step returned", flush=True)
        except KeyboardInterrupt:
            alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
            print("KeyboardInterrupt; workers alive:", alive, "usable:", agg.usable, flush=True)
        agg.close()
    """)
    first = p.stdout.readline()
    assert first.startswith("pids"), first + p.stderr.read()
    pids = [int(v) for v in first.split()[1:]]
    time.sleep(0.5)  # well inside the second step
    begin = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert time.monotonic() - begin < 5
    assert "KeyboardInterrupt; workers alive: [] usable: False" in out, out + err
    assert p.returncode == 0, err
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}")


def test_ctrl_c_uncaught_ends_the_program_cleanly():
    p = run_python("""
        import time, torch, gradagg
        model = torch.nn.Linear(2, 1)
        def shard(ctx):
            time.sleep(60)
            return model(torch.ones(3, 2)).sum(), 3
        with gradagg.Aggregator(model, shard, workers=2) as agg:
            print("stepping", flush=True)
            agg.step()
    """)
    assert p.stdout.readline().startswith("stepping")
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode != 0
    assert "KeyboardInterrupt" in err
    assert "Fatal" not in err and "core dumped" not in err


def test_two_threads_stepping_one_aggregator_take_turns():
    model = mlp()
    x, y = data(24)
    errors = []
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        def run():
            try:
                for _ in range(50):
                    agg.step()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert agg.steps_done == 100


def test_an_aggregator_never_closed_ends_with_the_interpreter():
    p = run_python("""
        import torch, gradagg
        model = torch.nn.Linear(2, 1)
        agg = gradagg.Aggregator(model, lambda ctx: model(torch.ones(3, 2)).sum(), workers=2)
        agg.step()
        print("pids", *agg.worker_pids, flush=True)
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "Fatal" not in err and "Error" not in err, err
    pids = [int(v) for v in out.split()[1:]]
    time.sleep(0.2)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def _expect_full_batch(model, x, y):
    from models import full_batch_grads
    want = full_batch_grads(model, x, y)
    return all(torch.allclose(p.grad, w, rtol=1e-5, atol=1e-7)
               for p, w in zip(model.parameters(), want))


def test_workers_outlive_the_thread_that_made_the_aggregator():
    # PR_SET_PDEATHSIG fires when the forking *thread* ends; the workers must not die.
    model = mlp()
    x, y = data(24)
    made = {}
    t = threading.Thread(target=lambda: made.update(
        agg=gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 3, False)), workers=3)))
    t.start()
    t.join()
    time.sleep(0.2)
    with made["agg"] as agg:
        assert agg.usable
        agg.step()
        assert _expect_full_batch(model, x, y)


def test_workers_outlive_the_thread_pool_task_that_made_the_aggregator():
    # A ThreadPoolExecutor's thread may end (shutdown) while the Aggregator lives on.
    import concurrent.futures
    model = mlp()
    x, y = data(24)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    agg = pool.submit(gradagg.Aggregator, model, shard_fn(model, x, y, bounds(24, 2, False)),
                      workers=2).result()
    pool.shutdown(wait=True)  # the thread that forked the workers has ended
    time.sleep(0.2)
    with agg:
        assert agg.usable
        agg.step()
        assert _expect_full_batch(model, x, y)


def _child_steps_the_copy(agg, queue):
    try:
        agg.step()
        queue.put("stepped")
    except gradagg.NotUsable as e:
        queue.put("not usable: " + str(e))
    except BaseException as e:  # noqa: BLE001 - the test reports what it was
        queue.put("other: " + repr(e))


def test_a_multiprocessing_fork_child_never_touches_the_workers():
    # A multiprocessing child (fork start method) exits normally, running the
    # finalizers of its copy: the parent's workers must go on.
    import multiprocessing
    model = mlp()
    x, y = data(24)
    ctx = multiprocessing.get_context("fork")
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        queue = ctx.Queue()
        child = ctx.Process(target=_child_steps_the_copy, args=(agg, queue))
        child.start()
        said = queue.get(timeout=30)
        child.join(30)
        assert child.exitcode == 0, child.exitcode
        assert said.startswith("not usable") and "copy made by fork()" in said, said
        assert agg.usable
        agg.step()
        assert _expect_full_batch(model, x, y)


def test_a_process_forked_inside_the_with_block_never_stops_the_workers():
    model = mlp()
    x, y = data(24)
    with gradagg.Aggregator(model, shard_fn(model, x, y, bounds(24, 2, False)), workers=2) as agg:
        pid = os.fork()
        if pid == 0:  # the user's fork: a copy of everything, the Aggregator too
            code = 0
            try:
                agg.step()
                code = 2
            except gradagg.NotUsable as e:
                code = 0 if "copy made by fork()" in str(e) else 4
            except BaseException:
                code = 8
            agg.__exit__(None, None, None)  # leaving the with block in the copy
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert agg.usable
        agg.step()
        assert _expect_full_batch(model, x, y)
