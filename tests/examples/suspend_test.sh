#!/usr/bin/env bash
# Stopping the whole job (SIGSTOP to its process group, as Ctrl-Z or a paused VM
# does) for 3x the step timeout, then SIGCONT: the training goes on and ends
# well, every try.
#
#   tests/examples/suspend_test.sh <fashion_mnist binary> [tries] [data dir]
set -uo pipefail

fashion=$1
tries=${2:-3}
data=${3:-/usr/share/datasets/fashion-mnist}
source "$(dirname "$0")/common.sh"
need_fashion_data "$data"
make_work_dir suspend

survived=0
for try in $(seq 1 "$tries"); do
  # Its own process group, like a shell job; a step timeout of 2 s, stopped for 6 s.
  # (With 1 s, a step resumed while the parallel test run's other tests hold both
  # cores once missed its deadline under ASan: the time it had left is what is tested.)
  setsid "$fashion" --data "$data" --workers 2 --epochs 1 --step-timeout 2 >"$work/out" 2>&1 &
  leader=$!
  for _ in $(seq 1 600); do
    grep -q "^epoch 1/1 .*steps" "$work/out" && break
    sleep 0.05
  done
  kill -STOP -- -"$leader"
  sleep 6
  kill -CONT -- -"$leader"
  wait "$leader"
  rc=$?
  if [ "$rc" = 0 ] && grep -q "^done" "$work/out"; then
    survived=$((survived + 1))
  else
    echo "try $try: exit $rc"
    tail -3 "$work/out"
  fi
done
echo "stopped for 3x the step timeout: $survived of $tries tries went on to the end"
[ "$survived" = "$tries" ]
