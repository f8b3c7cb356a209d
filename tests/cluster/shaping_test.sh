#!/usr/bin/env bash
# The emulated link really runs at its rate:
#   shaping_test.sh RATE MIB MIN_MBIT MAX_MBIT
# One TCP stream (throughput.py) sends MIB MiB from machine 0 to machine 1 over
# a cluster with links of RATE; the measured rate must lie in
# [MIN_MBIT, MAX_MBIT] Mbit/s. Skips (77) without python3.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -ge 4 ] || fail "usage: $0 RATE MIB MIN_MBIT MAX_MBIT"
rate=$1 mib=$2 min=$3 max=$4
command -v python3 >/dev/null || cluster_skip "no python3 (for throughput.py)"

cluster_up 2 "$rate"
echo "cluster $CLUSTER: 2 machines, links of $rate"
start_node 1 -- python3 "$HERE/throughput.py" recv 5001
start_node 0 -- python3 "$HERE/throughput.py" send "$(cluster_addr 1)" 5001 "$mib"
for k in 0 1; do wait_exit "$k" $(($(now_ms) + 50000)); done
for k in 0 1; do [ "${RC[$k]}" = 0 ] || fail "throughput.py on machine $k exited ${RC[$k]}"; done
read -r bytes seconds mbit <"$LOG_DIR/node1.log"
echo "received $bytes bytes in $seconds s: $mbit Mbit/s"
[ "$bytes" = $((mib * 1024 * 1024)) ] || fail "received $bytes bytes, not $mib MiB"
awk -v m="$mbit" -v lo="$min" -v hi="$max" 'BEGIN { exit !(m >= lo && m <= hi) }' ||
  fail "$mbit Mbit/s is outside [$min, $max]"
assert_no_process_left 5
echo "PASS: $rate measured at $mbit Mbit/s"
