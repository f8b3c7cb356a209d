#!/usr/bin/env bash
# Every example, given bad input, ends with its documented exit code
# (examples/exit_status.h: 2 bad input, 3 training failed, 4 a file) and a
# message on stderr, never by a signal (no SIGABRT, no core), and leaves no
# temporary file next to a checkpoint it could not write.
#
#   tests/examples/bad_input_test.sh <dir with the example binaries> [data dir]
set -uo pipefail

bin=$1
data=${2:-/usr/share/datasets/fashion-mnist}
parity=$bin/linear_regression_parity
fashion=$bin/fashion_mnist
population=$bin/population_softmax
source "$(dirname "$0")/common.sh"
need_fashion_data "$data"
make_work_dir badinput

runs=0
failures=0
by_signal=0

# expect CODE NAME COMMAND...: the command exits with CODE and says something on
# stderr (matching $SAYS, an extended regex, when set; in one line with ONE_LINE=1).
expect() {
  local want=$1 name=$2 pattern=${SAYS:-.}
  shift 2
  runs=$((runs + 1))
  timeout -s KILL 120 "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  local said lines
  said=$(grep -v '^\s*$' "$work/err" | head -1 | cut -c1-160)
  lines=$(grep -c . "$work/err")
  if [ "$rc" -ge 128 ]; then by_signal=$((by_signal + 1)); fi
  if [ "$rc" != "$want" ] || [ -z "$said" ] || ! grep -qE "$pattern" "$work/err" ||
    { [ -n "${ONE_LINE:-}" ] && [ "$lines" != 1 ]; }; then
    failures=$((failures + 1))
    echo "FAIL $name: exit $rc (want $want); stderr: ${said:-(nothing)}"
    tail -5 "$work/out" "$work/err"
  else
    echo "ok   $name: exit $rc: $said"
  fi
}

# ---- the parity demo
expect 2 "parity --workers 0" "$parity" --workers 0
expect 2 "parity --steps -1" "$parity" --steps -1
expect 2 "parity --no-such-flag" "$parity" --no-such-flag
expect 2 "parity GRADAGG_NNODES=two" env GRADAGG_NNODES=two "$parity"
expect 2 "parity GRADAGG_NODE_TIMEOUT_MS=soon" env GRADAGG_NODE_TIMEOUT_MS=soon "$parity"
expect 2 "parity --node-rank 2 of 2" "$parity" --nodes 2 --node-rank 2
expect 3 "parity: a node alone (rendezvous timeout)" \
  env GRADAGG_NODE_TIMEOUT_MS=1000 "$parity" --nodes 2 --node-rank 1 --store "$work/store"

# A process limit (ulimit -u; root ignores it, so as nobody where we can): the
# worker that could not be forked, or could not start its thread, is named with
# the cause. Which of the two depends on the user's other processes.
if [ "$(id -u)" != 0 ]; then
  as_limited=(bash -c 'ulimit -u "$0" && exec "$@"')
elif command -v setpriv >/dev/null &&
  setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$parity" 2>/dev/null; then
  as_limited=(setpriv --reuid=65534 --regid=65534 --clear-groups bash -c 'ulimit -u "$0" && exec "$@"')
fi
if [ -n "${as_limited+x}" ]; then
  for n in 2 8; do
    SAYS="fork failed \(a process limit|could not start a thread \(a process or thread limit" \
      expect 3 "parity under ulimit -u $n" "${as_limited[@]}" "$n" "$parity" --steps 3
  done
fi

# ---- Fashion-MNIST
small=(--data "$data" --limit 600 --epochs 1)
expect 2 "fashion --data missing" "$fashion" --data "$work/nothing"
mkdir -p "$work/corrupt"
cp "$data"/* "$work/corrupt/"
gzip -dc "$data/train-labels-idx1-ubyte.gz" | head -c 1000 >"$work/corrupt/train-labels-idx1-ubyte"
rm "$work/corrupt/train-labels-idx1-ubyte.gz"
expect 2 "fashion: a truncated data file" "$fashion" --data "$work/corrupt" --limit 600
# An empty training set (IDX headers that say 0 images): one line, not a shape error.
mkdir -p "$work/empty"
cp "$data"/t10k-* "$work/empty/"
printf '\x00\x00\x08\x03\x00\x00\x00\x00\x00\x00\x00\x1c\x00\x00\x00\x1c' \
  >"$work/empty/train-images-idx3-ubyte"
printf '\x00\x00\x08\x01\x00\x00\x00\x00' >"$work/empty/train-labels-idx1-ubyte"
SAYS="holds no images" expect 2 "fashion: an empty training set" "$fashion" --data "$work/empty"
SAYS="holds no images" expect 2 "population: an empty training set" "$population" \
  --data "$work/empty" --steps 10 --interval 5
SAYS="not in range" expect 2 "fashion --hidden 100000000" "$fashion" "${small[@]}" \
  --hidden 100000000
expect 2 "fashion --workers 0" "$fashion" --workers 0
expect 2 "fashion --lr -1" "$fashion" --lr -1
expect 2 "fashion --optimizer rmsprop" "$fashion" --optimizer rmsprop
expect 2 "fashion --step-timeout 0" "$fashion" --step-timeout 0
expect 2 "fashion GRADAGG_NNODES=abc" env GRADAGG_NNODES=abc "$fashion"
expect 4 "fashion --checkpoint in a missing directory" "$fashion" "${small[@]}" \
  --checkpoint "$work/missing/run.ckpt"
expect 4 "fashion --checkpoint a directory" "$fashion" "${small[@]}" --checkpoint "$work"
expect 4 "fashion --metrics unwritable" "$fashion" "${small[@]}" --metrics /proc/gradagg.csv
printf 'x%.0s' $(seq 1 1100) >"$work/full.csv"
expect 4 "fashion --metrics past the file-size limit" \
  bash -c 'ulimit -f 1 && exec "$@"' _ "$fashion" "${small[@]}" --metrics "$work/full.csv"
# A good checkpoint, then resumes that cannot be.
expect_ok() {
  runs=$((runs + 1))
  if ! "$@" >"$work/out" 2>&1; then
    failures=$((failures + 1))
    echo "FAIL $*: did not succeed"
    tail -5 "$work/out"
  fi
}
expect_ok "$fashion" "${small[@]}" --checkpoint "$work/good.ckpt"
expect 4 "fashion --resume with another --batch" "$fashion" "${small[@]}" --batch 20 \
  --resume "$work/good.ckpt"
head -c 5000 "$work/good.ckpt" >"$work/short.ckpt"
expect 4 "fashion --resume a truncated checkpoint" "$fashion" "${small[@]}" \
  --resume "$work/short.ckpt"
cp "$work/good.ckpt" "$work/flipped.ckpt"
printf '\x55' | dd of="$work/flipped.ckpt" bs=1 seek=4000 conv=notrunc status=none
expect 4 "fashion --resume a corrupted checkpoint" "$fashion" "${small[@]}" \
  --resume "$work/flipped.ckpt"
echo "not a checkpoint" >"$work/text.ckpt"
expect 4 "fashion --resume a text file" "$fashion" "${small[@]}" --resume "$work/text.ckpt"
# A header that agrees with a 1 TiB (sparse) file: refused for want of memory, not bad_alloc.
# (Not under ASan, whose operator new aborts on a failed allocation instead of throwing.)
# (grep -c, not -q: with pipefail, grep -q's early exit would fail ldd with SIGPIPE.)
if [ "$(ldd "$fashion" 2>/dev/null | grep -c libasan)" = 0 ]; then
  { printf 'GRADAGG CKPT v1\n\x00\x00\x00\x00\x00\x01\x00\x00'; head -c 8 /dev/zero; } \
    >"$work/huge.ckpt"
  truncate -s $(((1 << 40) + 32)) "$work/huge.ckpt"
  ONE_LINE=1 SAYS="do not fit in this process's memory" expect 4 \
    "fashion --resume a huge checkpoint" "$fashion" "${small[@]}" --resume "$work/huge.ckpt"
  rm -f "$work/huge.ckpt"
fi
expect 3 "fashion: a node alone (rendezvous timeout)" env GRADAGG_NODE_TIMEOUT_MS=1000 \
  "$fashion" "${small[@]}" --nodes 2 --node-rank 0 --store "$work/store2"
leftover=$(find "$work" -name '*.tmp-*' -o -name '*.probe-*')
if [ -n "$leftover" ]; then
  failures=$((failures + 1))
  echo "FAIL temporary files left: $leftover"
fi

# ---- population mode
pop=(--data "$data" --steps 20 --interval 10 --workers 2)
expect 2 "population --p 1.5" "$population" --p 1.5
expect 2 "population --fraction 0.9" "$population" --fraction 0.9
expect 2 "population --lr-min above --lr-max" "$population" --lr-min 1 --lr-max 0.1
expect 2 "population --workers 0" "$population" --workers 0
expect 2 "population --step-timeout 0" "$population" --step-timeout 0
expect 2 "population --data missing" "$population" --data "$work/nothing"
expect 4 "population --lineage unwritable" "$population" "${pop[@]}" --lineage /proc/x.jsonl
expect 4 "population --checkpoint in a missing directory" "$population" "${pop[@]}" \
  --checkpoint "$work/missing/pop.ckpt"
expect 4 "population --resume a text file" "$population" "${pop[@]}" --resume "$work/text.ckpt"
# Each example's checkpoint given to the other: refused by its kind, in one line.
expect_ok "$population" "${pop[@]}" --checkpoint "$work/pop.ckpt"
ONE_LINE=1 SAYS="pop.ckpt: is a population checkpoint" expect 4 \
  "fashion --resume a population checkpoint" "$fashion" "${small[@]}" --resume "$work/pop.ckpt"
ONE_LINE=1 SAYS="good.ckpt: is not a population checkpoint .*it is a gradagg::Checkpoint" expect 4 \
  "population --resume a fashion_mnist checkpoint" "$population" "${pop[@]}" \
  --resume "$work/good.ckpt"

# A member killed, and a member stopped past --step-timeout, while it trains.
member_fault() {
  local signal=$1
  "$population" --data "$data" --steps 100000 --interval 50 --workers 2 --step-timeout 2 \
    >"$work/out" 2>"$work/err" &
  local parent=$! member=""
  for _ in $(seq 1 200); do
    member=$(pgrep -P "$parent" | head -1)
    [ -n "$member" ] && grep -q . /proc/"$member"/stat 2>/dev/null && break
    sleep 0.05
  done
  sleep 1.5
  kill -"$signal" "$member"
  wait "$parent"
  echo $?
  kill -CONT "$member" 2>/dev/null
}
for signal in KILL STOP; do
  runs=$((runs + 1))
  rc=$(member_fault $signal)
  said=$(grep -v '^\s*$' "$work/err" | head -1 | cut -c1-160)
  if [ "$rc" -ge 128 ]; then by_signal=$((by_signal + 1)); fi
  if [ "$rc" != 3 ]; then
    failures=$((failures + 1))
    echo "FAIL population, a member got SIG$signal: exit $rc (want 3): $said"
  else
    echo "ok   population, a member got SIG$signal: exit $rc: $said"
  fi
done

echo "$runs runs, $failures failed, $by_signal ended by a signal"
[ "$failures" = 0 ]
