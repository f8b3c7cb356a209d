#!/usr/bin/env bash
# A cable unplugged mid-run:
#   link_down_test.sh LINEAR_REGRESSION_PARITY
# Two machines at 1gbit run a long parity demo (node timeout 3 s). Once they
# train, node 1's cable is unplugged at the switch. Node 0 must end non-zero
# naming NodeFailed within the timeout plus a margin of 6 s, and so must the
# cut-off node 1; no process may be left in the machines.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -ge 1 ] || fail "usage: $0 LINEAR_REGRESSION_PARITY"
bin=$1 timeout_ms=3000 margin_ms=6000
[ -x "$bin" ] || fail "no executable $bin"

cluster_up 2 1gbit
echo "cluster $CLUSTER: 2 machines, links of 1gbit, node timeout $timeout_ms ms"
for k in 0 1; do
  # 30000 steps: about a minute of training, far longer than the test.
  start_node "$k" GRADAGG_NODE_TIMEOUT_MS=$timeout_ms -- "$bin" --workers 2 --nodes 2 --steps 30000 \
    --node-rank "$k" --master-addr "$(cluster_addr 0)" --master-port 29500 \
    --ifname "$(cluster_ifname "$k")"
done
# Training: the steps' allreduces, thousands of packets (the rendezvous is < 100).
wait_for_traffic 1 3000 30
sleep 0.5
fault=$(now_ms)
cluster_link_down 1
echo "unplugged node 1's cable at the switch"
for k in 0 1; do wait_exit "$k" $((fault + timeout_ms + margin_ms)); done
for k in 0 1; do echo "node $k ended $((EXIT_MS[k] - fault)) ms after the fault"; done
assert_node_failed 0
assert_node_failed 1
assert_no_process_left 5
echo "PASS: both nodes ended with NodeFailed within $timeout_ms ms + $margin_ms ms"
