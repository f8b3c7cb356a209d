"""The job's edges across nodes, from Python: the job token, Ctrl-C while a node
waits on the others (at the rendezvous, for a slow peer), and what an interrupted
rendezvous leaves behind."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

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


# -- what an interrupted start-up leaves: nothing ----------------------------------------------

TCP_NODE = """
    import os, signal, socket, sys, time, psutil, torch, gradagg
    rank, nodes, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    def on_alarm(*_):
        raise TimeoutError("the start-up took too long")  # a user's own timeout

    signal.signal(signal.SIGALRM, on_alarm)
    model = torch.nn.Linear(2, 1)
    options = gradagg.NodeOptions(nodes=nodes, node_rank=rank, master_addr="127.0.0.1",
                                  master_port=port, timeout=30)
    threads = len(os.listdir("/proc/self/task"))
    print("starting", flush=True)
    try:
        gradagg.Aggregator(model, lambda ctx: model(torch.ones(3, 2)).sum(), workers=1,
                           nodes=options)
    except (KeyboardInterrupt, TimeoutError) as e:
        print(type(e).__name__, flush=True)
    time.sleep(0.2)
    me = psutil.Process()
    free = True  # node 0's port (another node's is node 0's server's)
    if rank == 0:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("127.0.0.1", port))
            server.listen()
        except OSError:
            free = False
        server.close()
    print("children", [c.pid for c in me.children(recursive=True)], flush=True)
    print("port", "free" if free else "held", flush=True)
    print("connections", [c.raddr.port for c in me.connections("tcp")
                          if c.raddr and c.raddr.port == port], flush=True)
    print("threads", len(os.listdir("/proc/self/task")) - threads, flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_node(rank, nodes, port):
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TCP_NODE), str(rank), str(nodes),
                          str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "starting"
    return p


def what_it_left(p, interrupt):
    time.sleep(1.5)  # in the rendezvous: waiting for a node that never comes
    interrupt(p)
    out, err = p.communicate(timeout=20)
    lines = dict(line.split(" ", 1) for line in out.splitlines()[1:])
    return out.splitlines()[0], lines, out + err


@pytest.mark.parametrize("rank,interrupt,raised", [
    (0, lambda p: p.send_signal(signal.SIGINT), "KeyboardInterrupt"),
    (0, lambda p: p.send_signal(signal.SIGALRM), "TimeoutError"),
    (1, lambda p: p.send_signal(signal.SIGINT), "KeyboardInterrupt"),
    (1, lambda p: p.send_signal(signal.SIGALRM), "TimeoutError"),
], ids=["node0-ctrl-c", "node0-handler-raises", "node1-ctrl-c", "node1-handler-raises"])
def test_an_interrupted_rendezvous_leaves_no_server_client_or_thread(rank, interrupt, raised):
    # A Python exception out of the rendezvous (Ctrl-C's KeyboardInterrupt, or what a signal
    # handler raises) is no C++ std::exception: the start-up's store is closed and its thread
    # joined all the same, and node 0's server process stopped, so the program that goes on
    # holds nothing of it: no child, no listening port, no connection, no thread.
    port = free_port()
    zero = tcp_node(0, 3, port) if rank == 1 else None  # node 0 serves, node 2 never comes
    try:
        first, left, text = what_it_left(tcp_node(rank, 3, port), interrupt)
    finally:
        if zero is not None:
            zero.kill()
            zero.communicate()
    assert first == raised, text
    assert left["children"] == "[]", text
    assert left["port"] == "free", text
    assert left["connections"] == "[]", text
    assert left["threads"] == "0", text
