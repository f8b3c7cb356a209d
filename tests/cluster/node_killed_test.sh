#!/usr/bin/env bash
# A node parent killed (SIGKILL) mid-run:
#   node_killed_test.sh FASHION_MNIST RANK
# Two machines at 1gbit train Fashion-MNIST (2 workers each, node timeout 3 s).
# Once both train, node RANK's parent gets kill -9. The other node must end
# non-zero naming NodeFailed within the timeout plus a margin of 6 s, and the
# killed node's workers must end too: no process left in the machines.
# Skips (77) without the dataset ($FASHION_MNIST_DIR, default
# /usr/share/datasets/fashion-mnist).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -ge 2 ] || fail "usage: $0 FASHION_MNIST RANK"
bin=$1 victim=$2 data=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
timeout_ms=3000 margin_ms=6000
[ -x "$bin" ] || fail "no executable $bin"
[ "$victim" = 0 ] || [ "$victim" = 1 ] || fail "RANK must be 0 or 1"
[ -f "$data/train-images-idx3-ubyte.gz" ] || [ -f "$data/train-images-idx3-ubyte" ] ||
  cluster_skip "no Fashion-MNIST in $data (Debian package dataset-fashion-mnist)"
survivor=$((1 - victim))

cluster_up 2 1gbit
echo "cluster $CLUSTER: 2 machines, links of 1gbit, node timeout $timeout_ms ms"
for k in 0 1; do
  start_node "$k" GRADAGG_NODE_TIMEOUT_MS=$timeout_ms -- "$bin" --data "$data" --workers 2 \
    --epochs 50 --nodes 2 --node-rank "$k" --master-addr "$(cluster_addr 0)" --master-port 29500 \
    --ifname "$(cluster_ifname "$k")"
done
# Training: a progress line ("epoch 1/50  10/469 steps ...") on both nodes.
for k in 0 1; do wait_for_log "$k" '^epoch [0-9]+/[0-9]+ +[0-9]+/[0-9]+ steps' 40; done
sleep 0.5
fault=$(now_ms)
kill -9 "${NODE_PID[$victim]}"
echo "killed node $victim's parent (pid ${NODE_PID[$victim]})"
wait_exit "$survivor" $((fault + timeout_ms + margin_ms))
wait_exit "$victim" $((fault + 1000))
echo "node $survivor ended $((EXIT_MS[survivor] - fault)) ms after the kill"
[ "${RC[$victim]}" = 137 ] || fail "node $victim exited ${RC[$victim]}, not by the SIGKILL"
assert_node_failed "$survivor"
assert_no_process_left 5
echo "PASS: node $survivor ended with NodeFailed within $timeout_ms ms + $margin_ms ms, nothing left"
