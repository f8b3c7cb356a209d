#!/usr/bin/env bash
# A stop signal ends a node that waits on the other nodes at once, not at its
# node timeout (60 s here): SIGTERM or SIGINT to a node 0 whose peer never
# comes, to a node 1 whose node 0 is not up (TCPStore), and to a node 0 whose
# peer is stopped (SIGSTOP) in the middle of training; each exits with 128 +
# the signal within a few seconds, and a waiting node's stderr is one line.
#
#   tests/examples/stop_while_waiting_test.sh <fashion_mnist> [data dir]
set -uo pipefail

fashion=$1
data=${2:-/usr/share/datasets/fashion-mnist}
source "$(dirname "$0")/common.sh"
need_fashion_data "$data"
make_work_dir stopwaiting
small=(--data "$data" --workers 1 --threads 1 --epochs 50 --limit 600)
failures=0

# quiet NAME: the node's stderr is the one waiting line and the line it ended
# with, not c10d's log.
quiet() {
  local waiting lines
  waiting=$(grep -c "waiting for the other nodes" "$work/err")
  lines=$(wc -l <"$work/err")
  if [ "$waiting" != 1 ] || [ "$lines" != 2 ]; then
    failures=$((failures + 1))
    echo "FAIL $name: $waiting waiting lines, $lines lines on stderr:"
    head -5 "$work/err"
  fi
}

# at_rendezvous: wait until the node has loaded the data and waited 1.5 s on its peers.
at_rendezvous() {
  for _ in $(seq 300); do grep -q "steps per epoch" "$work/out" 2>/dev/null && break; sleep 0.05; done
  sleep 1.5
}

# check NAME WANT_RC SECONDS_AT_MOST PID SIGNAL_TIME
check() {
  local name=$1 want=$2 most=$3 pid=$4 sent=$5
  wait "$pid"
  local rc=$? took
  took=$(( $(date +%s%N) / 1000000 - sent ))
  if [ "$rc" != "$want" ] || [ "$took" -gt $((most * 1000)) ]; then
    failures=$((failures + 1))
    echo "FAIL $name: exit $rc (want $want) ${took} ms after the signal"
    tail -3 "$work/err"
  else
    echo "ok   $name: exit $rc ${took} ms after the signal"
  fi
}

for sig in TERM INT; do
  want=$([ $sig = TERM ] && echo 143 || echo 130)
  # Alone at the rendezvous: the peer never comes.
  rm -f "$work/store"
  (trap - INT; exec "$fashion" "${small[@]}" --nodes 2 --node-rank 0 --store "$work/store") \
    >"$work/out" 2>"$work/err" &
  pid=$!
  at_rendezvous
  sent=$(( $(date +%s%N) / 1000000 ))
  kill -$sig $pid
  check "SIG$sig at the rendezvous" "$want" 3 $pid "$sent"
  name="SIG$sig at the rendezvous" quiet
done

# Node 1 of a TCPStore whose node 0 is not up: the same.
port=$(( 20000 + RANDOM % 20000 ))
"$fashion" "${small[@]}" --nodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port $port \
  >"$work/out" 2>"$work/err" &
pid=$!
at_rendezvous
sent=$(( $(date +%s%N) / 1000000 ))
kill -TERM $pid
check "SIGTERM to node 1 whose node 0 is not up" 143 3 $pid "$sent"
name="node 1 whose node 0 is not up" quiet

# Waiting for a stopped peer in a step.
rm -f "$work/store"
"$fashion" "${small[@]}" --nodes 2 --node-rank 1 --store "$work/store" >"$work/out1" 2>"$work/err1" &
peer=$!
"$fashion" "${small[@]}" --nodes 2 --node-rank 0 --store "$work/store" >"$work/out" 2>"$work/err" &
pid=$!
for _ in $(seq 200); do grep -q "^epoch 1/" "$work/out" 2>/dev/null && break; sleep 0.1; done
kill -STOP $peer
sleep 1
sent=$(( $(date +%s%N) / 1000000 ))
kill -TERM $pid
check "SIGTERM waiting for a stopped peer" 143 3 $pid "$sent"
kill -KILL $peer 2>/dev/null
wait $peer 2>/dev/null

[ "$failures" = 0 ] || { echo "$failures failed"; exit 1; }
echo "all passed"
