#!/usr/bin/env bash
# fashion_mnist's checkpoints are never damaged by a failed or mismatched node,
# and SIGHUP / SIGTERM end a run like the conventions say (checkpoint, then
# 128 + the signal):
#   1. two loopback nodes, node 0 resumes from a good checkpoint while node 1
#      starts fresh: both exit 2 before a step, the checkpoint is byte-identical;
#   2. two fresh nodes with different --seed, node 0 told to checkpoint to the
#      same file: the same;
#   3. node 1 is killed mid-run while node 0 saves every step: node 0 exits 3,
#      and both nodes resume from its checkpoint;
#   4. SIGHUP (then SIGTERM) during a run: exit 129 (143), and the checkpoint
#      it wrote resumes to the end;
#   5. a second run on the --checkpoint path of a live one: refused at once
#      (exit 4, one line naming the first's pid), the first goes on; after the
#      first is killed with SIGKILL a new run writes that path;
#   6. SIGTERM twice within 20 ms (as timeout(1) sends it): exit 143 with a
#      checkpoint that resumes.
#
#   tests/examples/checkpoint_safety_test.sh <fashion_mnist binary> [data dir]
set -uo pipefail

fashion=$1
data=${2:-/usr/share/datasets/fashion-mnist}
source "$(dirname "$0")/common.sh"
need_fashion_data "$data"
make_work_dir ckptsafety
failures=0
fail() {
  failures=$((failures + 1))
  echo "FAIL $*"
}
run=(--data "$data" --workers 1 --limit 3000 --threads 1)
export GRADAGG_NODE_TIMEOUT_MS=5000

# A good checkpoint of one epoch on two nodes.
two_nodes() {  # two_nodes NAME ARGS0 -- ARGS1: runs both, sets RC0 RC1
  local name=$1
  shift
  local a=() b=()
  while [ "$1" != -- ]; do a+=("$1"); shift; done
  shift
  b=("$@")
  "$fashion" "${run[@]}" --nodes 2 --node-rank 0 --store "$work/$name.store" "${a[@]}" \
    >"$work/$name.0" 2>&1 &
  local p0=$!
  "$fashion" "${run[@]}" --nodes 2 --node-rank 1 --store "$work/$name.store" "${b[@]}" \
    >"$work/$name.1" 2>&1 &
  local p1=$!
  wait $p0; RC0=$?
  wait $p1; RC1=$?
}
two_nodes first --epochs 1 --checkpoint "$work/good.ckpt" -- --epochs 1
[ "$RC0$RC1" = 00 ] || fail "the first epoch on two nodes: exit $RC0 / $RC1"
sum=$(sha256sum <"$work/good.ckpt")

# 1 and 2: mismatched nodes refuse before a step and leave the checkpoint alone.
two_nodes fresh --epochs 2 --resume "$work/good.ckpt" --checkpoint "$work/good.ckpt" -- --epochs 2
[ "$RC0$RC1" = 22 ] || fail "resume vs fresh: exit $RC0 / $RC1 (want 2 / 2)"
grep -q "disagree on resume_identity" "$work/fresh.1" || fail "resume vs fresh: $(tail -1 "$work/fresh.1")"
two_nodes seed --epochs 2 --checkpoint "$work/good.ckpt" -- --epochs 2 --seed 2
[ "$RC0$RC1" = 22 ] || fail "different seeds: exit $RC0 / $RC1 (want 2 / 2)"
grep -q "must_match\[seed\]" "$work/seed.0" || fail "different seeds: $(tail -1 "$work/seed.0")"
[ "$(sha256sum <"$work/good.ckpt")" = "$sum" ] || fail "a mismatched node changed the checkpoint"
echo "mismatched nodes: exit $RC0 / $RC1; $(tail -1 "$work/seed.0" | cut -c1-150)"

# 3: node 1 killed while node 0 saves every step.
"$fashion" "${run[@]}" --epochs 50 --nodes 2 --node-rank 0 --store "$work/kill.store" \
  --checkpoint "$work/run.ckpt" --checkpoint-every 1 >"$work/kill.0" 2>&1 &
p0=$!
"$fashion" "${run[@]}" --epochs 50 --nodes 2 --node-rank 1 --store "$work/kill.store" \
  >"$work/kill.1" 2>&1 &
p1=$!
for _ in $(seq 1 400); do [ -e "$work/run.ckpt" ] && break; sleep 0.05; done
sleep 0.5
kill -KILL $p1
wait $p0; rc=$?
wait $p1 2>/dev/null
[ "$rc" = 3 ] || fail "node 0 after node 1 was killed: exit $rc (want 3)"
echo "node 0 after node 1 was killed: exit $rc: $(tail -1 "$work/kill.0" | cut -c1-150)"
# Intact: both nodes load it (verified, same settings) and go on for one more step.
two_nodes after --epochs 50 --resume "$work/run.ckpt" --stop-after 1 -- \
  --epochs 50 --resume "$work/run.ckpt" --stop-after 1
[ "$RC0$RC1" = 00 ] || fail "resuming after the kill: exit $RC0 / $RC1: $(tail -1 "$work/after.0")"
step=$(grep -m1 -o "resumed from .*" "$work/after.0")
[ -n "$step" ] || fail "the checkpoint left after the kill does not resume: $(tail -1 "$work/after.0")"
echo "the checkpoint left after the kill: $step"

# 4: SIGHUP and SIGTERM: the step ends, the checkpoint is written, exit 128 + signal.
for signal in HUP TERM; do
  "$fashion" "${run[@]}" --epochs 20 --checkpoint "$work/$signal.ckpt" >"$work/$signal.out" 2>&1 &
  p=$!
  for _ in $(seq 1 400); do grep -q "steps" "$work/$signal.out" && break; sleep 0.05; done
  kill -$signal $p
  wait $p; rc=$?
  want=$((128 + $(kill -l $signal)))
  [ "$rc" = $want ] || fail "SIG$signal: exit $rc (want $want)"
  "$fashion" "${run[@]}" --epochs 20 --resume "$work/$signal.ckpt" --stop-after 1 \
    >"$work/$signal.resume" 2>&1 || true
  grep -q "resumed from" "$work/$signal.resume" ||
    fail "SIG$signal: its checkpoint does not resume: $(tail -1 "$work/$signal.resume")"
  echo "SIG$signal: exit $rc, $(grep -m1 "resumed from" "$work/$signal.resume")"
done

# 5: two runs on one --checkpoint path at once.
"$fashion" "${run[@]}" --epochs 50 --checkpoint "$work/busy.ckpt" >"$work/busy.0" 2>&1 &
p0=$!
for _ in $(seq 1 400); do grep -q "^pid " "$work/busy.ckpt.lock" 2>/dev/null && break; sleep 0.05; done
started=$(date +%s%N)
"$fashion" "${run[@]}" --epochs 50 --checkpoint "$work/busy.ckpt" >"$work/busy.1" 2>&1
rc=$?
ms=$((($(date +%s%N) - started) / 1000000))
[ "$rc" = 4 ] || fail "a second run on a busy checkpoint: exit $rc (want 4)"
grep -q "is being written by process $p0 (its lock $work/busy.ckpt.lock)" "$work/busy.1" ||
  fail "a second run on a busy checkpoint does not name process $p0: $(tail -1 "$work/busy.1")"
[ "$(grep -c . "$work/busy.1")" = 1 ] || fail "a second run on a busy checkpoint said more than a line"
[ "$ms" -lt 15000 ] || fail "a second run on a busy checkpoint was refused after $ms ms"
kill -0 $p0 2>/dev/null || fail "the first run ended: $(tail -1 "$work/busy.0")"
echo "a second run on a busy checkpoint: exit $rc after $ms ms: $(cut -c1-150 "$work/busy.1")"
kill -KILL $p0
wait $p0 2>/dev/null
"$fashion" "${run[@]}" --epochs 50 --checkpoint "$work/busy.ckpt" --stop-after 1 \
  >"$work/busy.2" 2>&1
rc=$?
[ "$rc" = 0 ] || fail "a run after the holder was killed: exit $rc: $(tail -1 "$work/busy.2")"
echo "a run after the holder was killed with SIGKILL: exit $rc"

# 6: SIGTERM twice, 20 ms apart, as timeout(1) sends it (to the program, then to its group):
# one request, the checkpoint is written whole, exit 143.
"$fashion" "${run[@]}" --epochs 20 --checkpoint "$work/twice.ckpt" >"$work/twice.out" 2>&1 &
p=$!
for _ in $(seq 1 400); do grep -q "steps" "$work/twice.out" && break; sleep 0.05; done
kill -TERM $p
sleep 0.02
kill -TERM $p 2>/dev/null
wait $p; rc=$?
[ "$rc" = 143 ] || fail "SIGTERM twice: exit $rc (want 143)"
"$fashion" "${run[@]}" --epochs 20 --resume "$work/twice.ckpt" --stop-after 1 \
  >"$work/twice.resume" 2>&1 || true
grep -q "resumed from" "$work/twice.resume" ||
  fail "SIGTERM twice: its checkpoint does not resume: $(tail -1 "$work/twice.resume")"
echo "SIGTERM twice: exit $rc, $(grep -m1 "resumed from" "$work/twice.resume")"

[ "$failures" = 0 ] && echo "all checks passed"
[ "$failures" = 0 ]
