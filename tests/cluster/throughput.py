#!/usr/bin/env python3
"""TCP throughput of one connection, for checking an emulated link.

  throughput.py recv PORT                 accept one connection, count bytes,
                                          print "<bytes> <seconds> <Mbit/s>"
  throughput.py send HOST PORT MBYTES     send MBYTES MiB to HOST:PORT

The receiver's clock runs from the first byte to the end of the stream.
"""
import socket
import sys
import time


def recv(port):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    server.settimeout(30)
    conn, _ = server.accept()
    conn.settimeout(60)
    total = 0
    start = None
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        if start is None:
            start = time.monotonic()
        total += len(data)
    seconds = time.monotonic() - (start or time.monotonic())
    print(f"{total} {seconds:.3f} {total * 8 / max(seconds, 1e-9) / 1e6:.1f}")


def send(host, port, mbytes):
    chunk = b"\0" * (1 << 20)
    # The receiver may not listen yet: retry for a few seconds.
    deadline = time.monotonic() + 10
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    conn.settimeout(60)
    for _ in range(mbytes):
        conn.sendall(chunk)
    conn.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "recv":
        recv(int(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)
