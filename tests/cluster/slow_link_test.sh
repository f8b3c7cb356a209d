#!/usr/bin/env bash
# Training over a slow link (tbf 10mbit) with a short node timeout:
#   slow_link_test.sh FASHION_MNIST HIDDEN TIMEOUT_MS EXPECT [WHEN]
# Two machines (1 worker each) train 3 steps of Fashion-MNIST with HIDDEN
# hidden units. The broadcast of the initial parameters and every step's
# allreduce move 4 * (795 * HIDDEN + 10) bytes (6.5 MB at 2048, 4.9 MB at 1536,
# 0.2 MB at 64); 10mbit carries about 1.2 MB/s.
# WHEN: start          the links run at 10mbit from the start (default)
#       after-broadcast  1gbit until node 1 has the initial parameters, then
#                        node 1's cable drops to 10mbit (the steps run slowly)
# EXPECT is what must happen:
#   nodefailed  both nodes end non-zero naming NodeFailed, in a collective
#               (the broadcast or a step), not in the rendezvous
#   completed   both nodes exit 0 with the same test accuracy
#   any         either (the outcome is printed)
# In every case both must end within 50 s: no hang. Skips (77) without the
# dataset ($FASHION_MNIST_DIR, default /usr/share/datasets/fashion-mnist).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -ge 4 ] || fail "usage: $0 FASHION_MNIST HIDDEN TIMEOUT_MS EXPECT [WHEN]"
bin=$1 hidden=$2 timeout_ms=$3 expect=$4 when=${5:-start}
data=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
[ -x "$bin" ] || fail "no executable $bin"
case "$expect" in nodefailed|completed|any) ;; *) fail "EXPECT: nodefailed, completed or any" ;; esac
case "$when" in start) rate=10mbit ;; after-broadcast) rate=1gbit ;; *) fail "WHEN: start or after-broadcast" ;; esac
[ -f "$data/train-images-idx3-ubyte.gz" ] || [ -f "$data/train-images-idx3-ubyte" ] ||
  cluster_skip "no Fashion-MNIST in $data (Debian package dataset-fashion-mnist)"

cluster_up 2 "$rate"
echo "cluster $CLUSTER: 2 machines, links of $rate, node timeout $timeout_ms ms, hidden $hidden"
start=$(now_ms)
for k in 0 1; do
  start_node "$k" GRADAGG_NODE_TIMEOUT_MS="$timeout_ms" -- "$bin" --data "$data" --workers 1 \
    --hidden "$hidden" --limit 192 --epochs 1 --nodes 2 --node-rank "$k" \
    --master-addr "$(cluster_addr 0)" --master-port 29500 --ifname "$(cluster_ifname "$k")"
done
# The data are read: the setup line comes just before the rendezvous and the
# broadcast of the initial parameters.
for k in 0 1; do wait_for_log "$k" 'workers x batch' 30; done
ready=$(now_ms)
echo "both nodes read the data after $((ready - start)) ms"
if [ "$when" = after-broadcast ]; then
  # 90% of the parameters' bytes have reached node 1: then slow its cable.
  bytes=$((4 * (795 * hidden + 10) * 9 / 10))
  deadline=$(($(now_ms) + 30000))
  until [ "$(tc -s -n "$(cluster_switch)" qdisc show dev "$(cluster_port 1)" | awk '/Sent/ {print $2; exit}')" -ge "$bytes" ]; do
    has_exited "${NODE_PID[1]}" && fail "node 1 ended before the parameters reached it"
    [ "$(now_ms)" -lt "$deadline" ] || fail "the parameters did not reach node 1 within 30 s"
    sleep 0.02
  done
  cluster_set_rate 1 10mbit
  ready=$(now_ms)
  echo "node 1 has the parameters; its cable now runs at 10mbit"
fi
for k in 0 1; do wait_exit "$k" $((start + 50000)); done
for k in 0 1; do
  echo "node $k ended with exit code ${RC[$k]}$(describe_rc "${RC[$k]}") $((EXIT_MS[k] - ready)) ms after that"
done

if [ "${RC[0]}" = 0 ] && [ "${RC[1]}" = 0 ]; then
  outcome=completed
  acc0=$(grep -m1 -o 'test accuracy [0-9.]*' "$LOG_DIR/node0.log" || true)
  acc1=$(grep -m1 -o 'test accuracy [0-9.]*' "$LOG_DIR/node1.log" || true)
  [ -n "$acc0" ] && [ "$acc0" = "$acc1" ] || fail "the nodes report different results: '$acc0' vs '$acc1'"
  echo "both nodes: $acc0"
else
  outcome=nodefailed
  assert_node_failed 0
  assert_node_failed 1
  # A failed rendezvous is not the link's slowness (the nodes start together).
  ! grep -q 'rendezvous through' "$LOG_DIR/node0.log" "$LOG_DIR/node1.log" ||
    fail "the rendezvous failed, not a collective: too short a node timeout to start?"
fi
echo "OUTCOME: $outcome"
[ "$expect" = any ] || [ "$expect" = "$outcome" ] || fail "expected $expect"
assert_no_process_left 5
echo "PASS: over 10mbit ($when) with a $timeout_ms ms node timeout the run $outcome, no hang"
