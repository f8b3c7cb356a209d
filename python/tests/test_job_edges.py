"""The job's edges across nodes, from Python: the job token, and Ctrl-C while a
node waits on the others (at the rendezvous, for a slow peer)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

PYTHONPATH = os.pathsep.join(p for p in sys.path if p)

NODE = """
    import sys, time, torch, gradagg
    rank, store, token, slow = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    torch.manual_seed(1)  # the run's seed (the workers' by default): the same on every node
    model = torch.nn.Linear(2, 1)
    def shard(ctx):
        if ctx.step == 1 and slow:
            time.sleep(slow)
        return model(torch.ones(3, 2)).sum(), 3
    nodes = gradagg.NodeOptions(nodes=2, node_rank=rank, store_path=store, timeout=30,
                                token=token)
    print("starting", flush=True)
    begin = time.monotonic()
    try:
        with gradagg.Aggregator(model, shard, workers=1, nodes=nodes) as agg:
            agg.step()
            print("stepped", flush=True)
            begin = time.monotonic()
            agg.step()
        print("ok", flush=True)
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.monotonic() - begin:.2f} s", flush=True)
    except gradagg.Error as e:
        print(f"{type(e).__name__} after {time.monotonic() - begin:.2f} s: {e}", flush=True)
"""


def node(rank, store, token="", slow=0.0):
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(NODE), str(rank), store,
                             token, str(slow)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def seconds(line):
    return float(line.split(" after ")[1].split(" s")[0])


def test_nodes_with_other_tokens_are_refused_at_once_on_both_sides(tmp_path):
    store = str(tmp_path / "store")
    procs = [node(0, store, "token-a"), node(1, store, "token-b")]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    for out in outs:
        last = out.splitlines()[-1]
        assert last.startswith("InvalidArgument"), out
        assert "job token" in last, out
        assert seconds(last) < 10, out


def signal_a_lone_node(tmp_path, signum):
    """Node 0 alone at the rendezvous (node 1 never comes) gets `signum` after 1 s:
    (process, stdout, stderr, seconds from the signal to its end)."""
    p = node(0, str(tmp_path / "store"))
    assert p.stdout.readline().strip() == "starting"
    time.sleep(1.0)
    p.send_signal(signum)
    begin = time.monotonic()
    out, err = p.communicate(timeout=30)
    return p, out, err, time.monotonic() - begin


def test_ctrl_c_at_the_rendezvous_raises_keyboard_interrupt_at_once(tmp_path):
    _, out, err, took = signal_a_lone_node(tmp_path, signal.SIGINT)
    assert "KeyboardInterrupt" in out, out + err
    assert took < 2.0, out + err


def test_ctrl_c_while_waiting_for_a_slow_peer_and_the_peer_fails_at_once(tmp_path):
    store = str(tmp_path / "store")
    zero, one = node(0, store), node(1, store, slow=4.0)
    assert zero.stdout.readline().strip() == "starting"
    assert zero.stdout.readline().strip() == "stepped", zero.stderr.read()
    time.sleep(0.5)  # node 0 waits for node 1 in the second step's collective
    zero.send_signal(signal.SIGINT)
    out0, err0 = zero.communicate(timeout=30)
    out1, err1 = one.communicate(timeout=60)
    last0, last1 = out0.splitlines()[-1], out1.splitlines()[-1]
    assert last0.startswith("KeyboardInterrupt"), out0 + err0
    assert seconds(last0) < 0.5 + 1.0, out0
    assert last1.startswith("NodeFailed"), out1 + err1
    assert seconds(last1) < 4.0 + 5.0, out1  # at once after its slow step, not at 30 s


def test_sigterm_at_the_rendezvous_ends_the_node_at_once_with_143_and_no_child_left(tmp_path):
    p, out, err, took = signal_a_lone_node(tmp_path, signal.SIGTERM)
    # Python's default SIGTERM action: the process ends by the signal at once, not at the
    # rendezvous' 30 s timeout (the conftest fixture checks nothing is left in /dev/shm).
    assert p.returncode == -signal.SIGTERM, (p.returncode, out + err)
    assert took < 2.0, out + err
