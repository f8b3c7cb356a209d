#!/usr/bin/env bash
# The parity demo on two emulated machines joined by a link of RATE:
#   parity_test.sh LINEAR_REGRESSION_PARITY RATE [NODE_TIMEOUT_MS]
# Both nodes (2 workers each) must exit 0 and print the same "float32 bits"
# line, i.e. the same parameters to the bit, within 45 s.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -ge 2 ] || fail "usage: $0 LINEAR_REGRESSION_PARITY RATE [NODE_TIMEOUT_MS]"
bin=$1 rate=$2 timeout_ms=${3:-10000}
[ -x "$bin" ] || fail "no executable $bin"

cluster_up 2 "$rate"
echo "cluster $CLUSTER: 2 machines, links of $rate, node timeout $timeout_ms ms"
start=$(now_ms)
for k in 0 1; do
  start_node "$k" GRADAGG_NODE_TIMEOUT_MS="$timeout_ms" -- "$bin" --workers 2 --nodes 2 \
    --node-rank "$k" --master-addr "$(cluster_addr 0)" --master-port 29500 \
    --ifname "$(cluster_ifname "$k")"
done
for k in 0 1; do wait_exit "$k" $((start + 45000)); done
echo "both nodes ended after $(((EXIT_MS[1] > EXIT_MS[0] ? EXIT_MS[1] : EXIT_MS[0]) - start)) ms"

for k in 0 1; do
  [ "${RC[$k]}" = 0 ] || fail "node $k exited ${RC[$k]}$(describe_rc "${RC[$k]}")"
done
bits0=$(grep -m1 'float32 bits' "$LOG_DIR/node0.log" || true)
bits1=$(grep -m1 'float32 bits' "$LOG_DIR/node1.log" || true)
[ -n "$bits0" ] || fail "node 0 printed no 'float32 bits' line"
[ "$bits0" = "$bits1" ] || fail "the nodes differ: '$bits0' vs '$bits1'"
echo "node 0 and node 1:$bits0"
assert_no_process_left 5
echo "PASS: parity over $rate, the same bits on both nodes"
