#!/usr/bin/env bash
# An emulated cluster of N "machines" on this host, for tests of several nodes.
#
# Every machine K is a network namespace <prefix>n<K> with loopback up and one
# veth interface <prefix>v<K> holding 10.213.0.<K+1>/24. The other end of each
# veth (<prefix>b<K>) is a port of the bridge <prefix>br in the namespace
# <prefix>sw (the "switch"). Both ends of every link are limited with tc tbf to
# the same rate, so each direction of each cable runs at that rate. Nothing is
# created in this host's own namespace: interfaces are born in the namespaces.
#
# As a tool:
#   cluster.sh check                 can a cluster be made here? (exit 77 if not)
#   cluster.sh up N RATE             make one (RATE: 1gbit, 10gbit, 10mbit...);
#                                    prints its prefix, e.g. ga1234
#   cluster.sh exec K CMD...         run CMD in machine K
#   cluster.sh addr K | ifname K | ns K    machine K's address / interface / namespace
#   cluster.sh link-down K | link-up K     unplug / replug K's cable at the switch
#   cluster.sh rate K RATE           change the rate of K's cable (both directions)
#   cluster.sh down [PREFIX]         kill what runs in the namespaces, remove them
#   cluster.sh gc                    remove clusters whose owning test is gone
# Commands after `up` act on the cluster named by $CLUSTER (a prefix), or else
# on the last one `cluster.sh up` made (kept in $CLUSTER_STATE_DIR/last).
#
# As a library (source it): cluster_up N RATE sets CLUSTER; cluster_exec,
# cluster_addr, cluster_ifname, cluster_ns, cluster_link_down, cluster_link_up,
# cluster_down use it. The caller sets its own trap to call cluster_down.
#
# When a cluster cannot be made here (not root, no ip/tc, no namespaces, no
# veth/bridge/tbf) it says why in one line and exits with CLUSTER_SKIP (77),
# which CTest maps to "skipped" (SKIP_RETURN_CODE).

CLUSTER_SKIP=77
CLUSTER_STATE_DIR=${CLUSTER_STATE_DIR:-/tmp/gradagg-cluster}
CLUSTER_SUBNET=${CLUSTER_SUBNET:-10.213.0}

# Prints "cluster: skipped: <why>" and exits 77.
cluster_skip() {
  echo "cluster: skipped: $*" >&2
  exit "$CLUSTER_SKIP"
}

cluster_die() {
  echo "cluster: error: $*" >&2
  exit 1
}

# Rate in bits per second of a tc rate such as 10gbit, 100mbit, 125mbps, 1000000.
cluster_rate_bits() {
  local rate=$1 number unit
  number=${rate%%[!0-9]*}
  unit=${rate#"$number"}
  [ -n "$number" ] || cluster_die "bad rate '$rate' (e.g. 1gbit, 10mbit)"
  case "$unit" in
    ""|bit) echo $((number)) ;;
    kbit) echo $((number * 1000)) ;;
    mbit) echo $((number * 1000 * 1000)) ;;
    gbit) echo $((number * 1000 * 1000 * 1000)) ;;
    bps) echo $((number * 8)) ;;
    kbps) echo $((number * 8 * 1000)) ;;
    mbps) echo $((number * 8 * 1000 * 1000)) ;;
    gbps) echo $((number * 8 * 1000 * 1000 * 1000)) ;;
    *) cluster_die "bad rate '$rate' (e.g. 1gbit, 10mbit)" ;;
  esac
}

# tbf burst in bytes for a rate: what the rate sends in 4 ms (rate/HZ with
# HZ=250), at least 64 KiB (one GSO packet); 10gbit gives 5 MB.
cluster_burst_bytes() {
  local bits bytes
  bits=$(cluster_rate_bits "$1")
  bytes=$((bits / 8 / 250))
  [ "$bytes" -ge 65536 ] || bytes=65536
  echo "$bytes"
}

# Limits egress of DEV in namespace NS to RATE.
cluster_shape() {
  local ns=$1 dev=$2 rate=$3
  tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" \
    burst "$(cluster_burst_bytes "$rate")" latency 100ms
}

# Exits 77 with the reason unless namespaces, veth, bridge and tbf all work:
# builds and removes a throw-away namespace <prefix>probe.
cluster_check() {
  local probe
  [ "$(id -u)" = 0 ] || cluster_skip "needs root (network namespaces, tc); running as uid $(id -u)"
  command -v ip >/dev/null || cluster_skip "no 'ip' command (iproute2)"
  command -v tc >/dev/null || cluster_skip "no 'tc' command (iproute2)"
  probe=ga$$probe
  ip netns add "$probe" 2>/dev/null || cluster_skip "'ip netns add' fails here (no network namespaces?)"
  if ! ip -n "$probe" link add "${probe}a" type veth peer name "${probe}b" 2>/dev/null; then
    ip netns del "$probe"; cluster_skip "cannot create a veth pair in a namespace"
  fi
  if ! ip -n "$probe" link add "${probe}br" type bridge 2>/dev/null; then
    ip netns del "$probe"; cluster_skip "cannot create a bridge in a namespace"
  fi
  if ! tc -n "$probe" qdisc add dev "${probe}a" root tbf rate 1gbit burst 1mb latency 100ms 2>/dev/null; then
    ip netns del "$probe"; cluster_skip "'tc qdisc add ... tbf' fails (no sch_tbf?)"
  fi
  ip netns del "$probe"
}

# Names of machine K: namespace, interface inside it, its switch-side peer.
cluster_ns() { echo "${CLUSTER}n$1"; }
cluster_ifname() { echo "${CLUSTER}v$1"; }
cluster_port() { echo "${CLUSTER}b$1"; }
cluster_addr() { echo "${CLUSTER_SUBNET}.$(($1 + 1))"; }
cluster_switch() { echo "${CLUSTER}sw"; }

# cluster_up N RATE [OWNER]: makes the cluster, sets CLUSTER, writes the state
# file. OWNER: the pid of the test that owns it (`gc` removes the cluster once
# that process is gone), or "manual".
cluster_up() {
  local n=${1:-} rate=${2:-} owner=${3:-$$} k ns sw
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le 200 ] || cluster_die "up N RATE: N must be 2..200"
  [ -n "$rate" ] || cluster_die "up N RATE: no rate (e.g. 1gbit)"
  cluster_rate_bits "$rate" >/dev/null
  cluster_check
  cluster_gc
  # A prefix no namespace uses yet: ga<pid>, or ga<pid>x<i> if that is taken.
  CLUSTER=ga$$
  k=0
  while ip netns list | awk '{print $1}' | grep -qE "^${CLUSTER}(n[0-9]+|sw)$"; do
    k=$((k + 1))
    CLUSTER=ga$$x$k
  done
  mkdir -p "$CLUSTER_STATE_DIR"
  # The state file first: `down` finds whatever part was made.
  printf 'CLUSTER_N=%s\nCLUSTER_RATE=%s\nCLUSTER_OWNER=%s\n' "$n" "$rate" "$owner" \
    >"$CLUSTER_STATE_DIR/$CLUSTER"
  # `exec`, `down`... without $CLUSTER act on the last cluster made by hand.
  [ "$owner" != manual ] || echo "$CLUSTER" >"$CLUSTER_STATE_DIR/last"
  CLUSTER_N=$n
  CLUSTER_RATE=$rate
  # The switch: a namespace with a bridge.
  sw=$(cluster_switch)
  ip netns add "$sw"
  ip -n "$sw" link add "${CLUSTER}br" type bridge
  ip -n "$sw" link set "${CLUSTER}br" up
  for ((k = 0; k < n; k++)); do
    ns=$(cluster_ns "$k")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # The cable: one end in the machine, the other a bridge port in the switch.
    ip -n "$ns" link add "$(cluster_ifname "$k")" type veth peer name "$(cluster_port "$k")" netns "$sw"
    ip -n "$ns" addr add "$(cluster_addr "$k")/24" dev "$(cluster_ifname "$k")"
    ip -n "$sw" link set "$(cluster_port "$k")" master "${CLUSTER}br"
    # Both directions limited: the machine's egress and the switch port's egress.
    cluster_shape "$ns" "$(cluster_ifname "$k")" "$rate"
    cluster_shape "$sw" "$(cluster_port "$k")" "$rate"
    ip -n "$ns" link set "$(cluster_ifname "$k")" up
    ip -n "$sw" link set "$(cluster_port "$k")" up
  done
}

# Reads the state of cluster $CLUSTER (or the last one made) into CLUSTER_N, CLUSTER_RATE.
cluster_load() {
  if [ -z "${CLUSTER:-}" ]; then
    [ -f "$CLUSTER_STATE_DIR/last" ] || cluster_die "no cluster: run 'up N RATE' first or set CLUSTER"
    CLUSTER=$(cat "$CLUSTER_STATE_DIR/last")
  fi
  [ -f "$CLUSTER_STATE_DIR/$CLUSTER" ] || cluster_die "no state file $CLUSTER_STATE_DIR/$CLUSTER"
  # shellcheck disable=SC1090
  . "$CLUSTER_STATE_DIR/$CLUSTER"
}

cluster_node_index() {
  [[ "${1:-}" =~ ^[0-9]+$ ]] && [ "$1" -lt "$CLUSTER_N" ] || cluster_die "no machine '${1:-}' (0..$((CLUSTER_N - 1)))"
}

cluster_exec() {
  local k=$1
  shift
  cluster_node_index "$k"
  ip netns exec "$(cluster_ns "$k")" "$@"
}

# Unplug / replug machine K's cable at the switch: the machine keeps its address
# and route, but nothing gets through (veth: no carrier at either end).
cluster_link_down() {
  cluster_node_index "$1"
  ip -n "$(cluster_switch)" link set "$(cluster_port "$1")" down
}
cluster_link_up() {
  cluster_node_index "$1"
  ip -n "$(cluster_switch)" link set "$(cluster_port "$1")" up
}

# Changes the rate of machine K's cable, both ends.
cluster_set_rate() {
  cluster_node_index "$1"
  cluster_rate_bits "$2" >/dev/null
  cluster_shape "$(cluster_ns "$1")" "$(cluster_ifname "$1")" "$2"
  cluster_shape "$(cluster_switch)" "$(cluster_port "$1")" "$2"
}

# Kills every process in namespace $1 (SIGKILL) and waits until none is left there.
cluster_kill_ns() {
  local ns=$1 i
  for ((i = 0; i < 50; i++)); do
    [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] || return 0
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    sleep 0.1
  done
  echo "cluster: warning: processes still in $ns: $(ip netns pids "$ns" | tr '\n' ' ')" >&2
}

# Removes every namespace of cluster $CLUSTER (machines first, then the switch;
# removing a namespace removes its veth ends), and the state file. Safe to call
# twice and on a cluster made only in part; never fails.
cluster_down() {
  local ns
  [ -n "${CLUSTER:-}" ] || return 0
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${CLUSTER}(n[0-9]+|sw)$" || true); do
    cluster_kill_ns "$ns"
    ip netns del "$ns" 2>/dev/null || echo "cluster: warning: could not remove namespace $ns" >&2
  done
  rm -f "$CLUSTER_STATE_DIR/$CLUSTER"
  if [ -f "$CLUSTER_STATE_DIR/last" ] && [ "$(cat "$CLUSTER_STATE_DIR/last")" = "$CLUSTER" ]; then
    rm -f "$CLUSTER_STATE_DIR/last"
  fi
  return 0
}

# Removes every cluster whose owner process has ended (a test killed by CTest's
# TIMEOUT gets SIGKILL and cannot clean up after itself).
cluster_gc() {
  local file owner
  for file in "$CLUSTER_STATE_DIR"/ga*; do
    [ -f "$file" ] || continue
    owner=$(sed -n 's/^CLUSTER_OWNER=//p' "$file")
    if [[ "$owner" =~ ^[0-9]+$ ]] && ! kill -0 "$owner" 2>/dev/null; then
      echo "cluster: removing $(basename "$file"), its owner $owner is gone" >&2
      CLUSTER=$(basename "$file") cluster_down
    fi
  done
}

# EXIT trap of `up`: tears down what was made when `up` fails half way.
cluster_up_exit() {
  local rc=$?
  [ "$rc" = 0 ] || [ "$rc" = "$CLUSTER_SKIP" ] || cluster_down
  exit "$rc"
}

# The tool: dispatch the command line (only when executed, not when sourced).
cluster_main() {
  set -euo pipefail
  local cmd=${1:-}
  shift || true
  case "$cmd" in
    check) cluster_check; echo "cluster: namespaces, veth, bridge and tbf work here" ;;
    up)
      trap cluster_up_exit EXIT
      trap 'exit 130' INT TERM
      cluster_up "${1:-}" "${2:-}" manual
      trap - EXIT
      echo "$CLUSTER"
      ;;
    exec) cluster_load; [ $# -ge 2 ] || cluster_die "exec K CMD..."; cluster_exec "$@" ;;
    addr|ifname|ns) cluster_load; cluster_node_index "${1:-}"; "cluster_$cmd" "$1" ;;
    link-down) cluster_load; cluster_link_down "${1:-}" ;;
    link-up) cluster_load; cluster_link_up "${1:-}" ;;
    rate) cluster_load; cluster_set_rate "${1:-}" "${2:-}" ;;
    gc) cluster_gc ;;
    down)
      # `down [PREFIX]`: works without a state file too (a cluster made in part).
      [ -z "${1:-}" ] || CLUSTER=$1
      [ -n "${CLUSTER:-}" ] || cluster_load
      cluster_down
      ;;
    *)
      sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
      exit 2
      ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  cluster_main "$@"
fi
