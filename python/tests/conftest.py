"""Shared fixtures: every test must leave no child process and nothing in /dev/shm."""
import os
import subprocess
import sys
import time

import psutil
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def no_leftovers():
    shm_before = set(os.listdir("/dev/shm"))
    yield
    me = psutil.Process()
    deadline = time.monotonic() + 5
    while me.children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [(c.pid, c.name()) for c in me.children(recursive=True) if c.is_running()]
    assert not left, f"child processes left behind: {left}"
    # POSIX named semaphores ("sem.*") are never gradagg's (its segments are anonymous
    # mappings): they are multiprocessing's locks and glibc's temporaries of sem_open, whose
    # name pair a process SIGKILLed inside sem_open leaves behind (seen in CI: a test that
    # kills a worker whose DataLoader prefetch was making a queue). tests/check_leftovers.sh
    # likewise counts only gradagg's names.
    new = {n for n in set(os.listdir("/dev/shm")) - shm_before if not n.startswith("sem.")}
    # Another test running beside this one (ctest -j) may be creating a file this moment: a
    # DataLoader its "torch_*" files. A leak stays; a file that goes within a second was not
    # this test's.
    deadline = time.monotonic() + 1
    while new and time.monotonic() < deadline:
        time.sleep(0.05)
        new = {n for n in new if os.path.exists(os.path.join("/dev/shm", n))}
    assert not new, f"left in /dev/shm: {sorted(new)}"


def run_script(source, timeout=60, **kwargs):
    """Runs `source` in a fresh interpreter with gradagg importable; returns CompletedProcess."""
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          timeout=timeout, env=env, **kwargs)
