# shellcheck shell=bash
# What the cluster tests share (source it after `set -euo pipefail`).
#
# It sources cluster.sh (whose cluster_up first removes clusters left by
# earlier runs that were killed) and sets an EXIT trap that tears the test's
# cluster down (killing what still runs in it) and then checks that nothing is
# left: no namespace or interface with the prefix, no process started by the
# test, no new /dev/shm/gradagg* entry.
# A test whose checks passed but that leaves something behind fails.

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cluster.sh
. "$HERE/cluster.sh"

# Node logs, removed on success.
LOG_DIR=$(mktemp -d /tmp/gradagg-cluster-test-XXXXXX)
# /dev/shm before the test: other tests may run at the same time.
SHM_BEFORE=$(ls /dev/shm | grep -i gradagg || true)
# NODE_PID[K]: the node parent of machine K (ip netns exec execs it: same pid).
declare -a NODE_PID=()

now_ms() { echo $(($(date +%s%N) / 1000000)); }

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# Prints the tail of every node's log.
show_logs() {
  local log
  for log in "$LOG_DIR"/*.log; do
    [ -f "$log" ] || continue
    echo "----- $(basename "$log") (last 15 lines)"
    tail -n 15 "$log"
  done
}

# Whatever remains of this test: namespaces, interfaces in this namespace,
# processes whose command line names the cluster, new /dev/shm entries.
leftovers() {
  local shm_now
  ip netns list | awk '{print $1}' | grep -E "^${CLUSTER}(n[0-9]+|sw)$" | sed 's/^/namespace /' || true
  ip -o link | grep -F "$CLUSTER" | sed 's/^/interface /' || true
  pgrep -a -f -- "${CLUSTER}v[0-9]" | sed 's/^/process /' || true
  shm_now=$(ls /dev/shm | grep -i gradagg || true)
  comm -13 <(echo "$SHM_BEFORE" | sort) <(echo "$shm_now" | sort) | grep . | sed 's|^|/dev/shm/|' || true
}

on_exit() {
  local rc=$? left
  trap - EXIT
  set +e
  if [ -n "${CLUSTER:-}" ]; then
    cluster_down
    left=$(leftovers)
    if [ -n "$left" ]; then
      echo "FAIL: left behind after teardown:" >&2
      echo "$left" >&2
      [ "$rc" != 0 ] || rc=1
    else
      echo "cleanup: no namespace, interface, process or /dev/shm entry of $CLUSTER left"
    fi
  fi
  show_logs
  if [ "$rc" = 0 ] || [ "$rc" = "$CLUSTER_SKIP" ]; then rm -rf "$LOG_DIR"; else echo "logs kept in $LOG_DIR"; fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

# start_node K ENV=VALUE... -- BINARY ARGS...: starts a node in machine K in the
# background, output in $LOG_DIR/nodeK.log, its pid in NODE_PID[K].
start_node() {
  local k=$1
  shift
  local -a envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  cluster_node_index "$k"
  # A simple command in the background: its pid is ip's, which execs env,
  # which execs the binary. (No stdbuf: its LD_PRELOAD comes before the
  # sanitizer runtime of an ASan build; the examples flush their progress lines.)
  ip netns exec "$(cluster_ns "$k")" env "${envs[@]}" "$@" >"$LOG_DIR/node$k.log" 2>&1 &
  NODE_PID[$k]=$!
}

# True when process $1 has ended (gone, or a zombie not yet reaped).
has_exited() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null || true)
  [ -z "$state" ] || [[ "$state" == Z* ]]
}

# dump_stacks K: every thread's stack of every process in machine K (gdb, when
# there is one), into $LOG_DIR/stacks-nodeK.txt and the test's output.
dump_stacks() {
  command -v gdb >/dev/null || return 0
  local pid out="$LOG_DIR/stacks-node$1.txt"
  for pid in $(ip netns pids "$(cluster_ns "$1")"); do
    echo "=== pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"
    timeout 30 gdb -p "$pid" -batch -ex "thread apply all bt 30" 2>/dev/null | grep -E '^(Thread|#)' || true
  done > "$out"
  echo "----- stacks of node $1's processes ($out)"
  cat "$out"
}

# wait_exit K DEADLINE_MS: waits until node K ends or the clock passes
# DEADLINE_MS (from now_ms); sets EXIT_MS[K] and RC[K]. Fails the test on a hang.
declare -a EXIT_MS=() RC=()
wait_exit() {
  local k=$1 deadline=$2
  while ! has_exited "${NODE_PID[$k]}"; do
    if [ "$(now_ms)" -ge "$deadline" ]; then
      dump_stacks "$k"
      fail "node $k still running at its deadline: it hangs"
    fi
    sleep 0.05
  done
  EXIT_MS[$k]=$(now_ms)
  RC[$k]=0
  wait "${NODE_PID[$k]}" || RC[$k]=$?
}

# wait_for_log K REGEX SECONDS: waits until node K's log matches REGEX.
wait_for_log() {
  local k=$1 regex=$2 deadline=$(($(now_ms) + $3 * 1000))
  until grep -qE "$regex" "$LOG_DIR/node$k.log" 2>/dev/null; do
    has_exited "${NODE_PID[$k]}" && fail "node $k ended before its log showed /$regex/"
    [ "$(now_ms)" -lt "$deadline" ] || fail "node $k's log did not show /$regex/ within $3 s"
    sleep 0.05
  done
}

# Packets sent so far by the switch to machine K.
packets_to() {
  tc -s -n "$(cluster_switch)" qdisc show dev "$(cluster_port "$1")" | awk '/Sent/ {print $4; exit}'
}

# wait_for_traffic K PACKETS SECONDS: waits until the switch has sent PACKETS
# packets to machine K (the nodes are past the rendezvous and training).
wait_for_traffic() {
  local k=$1 want=$2 deadline=$(($(now_ms) + $3 * 1000))
  until [ "$(packets_to "$k")" -ge "$want" ]; do
    has_exited "${NODE_PID[$k]}" && fail "node $k ended before $want packets reached it"
    [ "$(now_ms)" -lt "$deadline" ] || fail "fewer than $want packets reached node $k within $3 s"
    sleep 0.05
  done
}

# assert_no_process_left SECONDS: after the nodes ended, nothing may run in the
# machines (workers must end with their parent) within SECONDS.
assert_no_process_left() {
  local deadline=$(($(now_ms) + $1 * 1000)) k
  local -a pids
  while :; do
    pids=()
    for ((k = 0; k < CLUSTER_N; k++)); do
      mapfile -t -O "${#pids[@]}" pids < <(ip netns pids "$(cluster_ns "$k")")
    done
    if [ "${#pids[@]}" = 0 ]; then
      echo "no process left in the machines"
      return 0
    fi
    if [ "$(now_ms)" -ge "$deadline" ]; then
      ps -o pid,ppid,stat,args -p "$(IFS=,; echo "${pids[*]}")" >&2 || true
      fail "processes still running in the machines $1 s after the nodes ended"
    fi
    sleep 0.1
  done
}

# The error a node must report when a peer fails: gradagg's NodeFailed message,
# the one line the examples print.
NODE_FAILED_RE='gradagg: node [0-9]+ of [0-9]+: .*failed'

# assert_node_failed K: node K ended with the examples' "training failed" code
# (3, examples/exit_status.h), not by a signal, and its log names the failure.
assert_node_failed() {
  local k=$1
  [ "${RC[$k]}" = 3 ] || fail "node $k exited ${RC[$k]}$(describe_rc "${RC[$k]}") after the fault, not 3 (training failed)"
  grep -qE "$NODE_FAILED_RE" "$LOG_DIR/node$k.log" || fail "node $k's log does not mention NodeFailed"
  echo "node $k: exit code ${RC[$k]}$(describe_rc "${RC[$k]}"): $(grep -m1 -oE 'gradagg: node [0-9]+ of .{0,200}' "$LOG_DIR/node$k.log" || grep -m1 NodeFailed "$LOG_DIR/node$k.log")"
}

describe_rc() {
  if [ "$1" -gt 128 ]; then echo " (signal $(kill -l $(($1 - 128))))"; fi
}
