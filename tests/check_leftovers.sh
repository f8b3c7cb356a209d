#!/usr/bin/env bash
# After the suite: nothing of ours in /dev/shm, no worker process left running,
# and no gradagg-* temporary directory made during the suite (TempDir, the
# cluster tests' logs) left behind.
# Workers are forks of the test programs, so they carry their names (15 chars).
#   tests/check_leftovers.sh [MARKER]   MARKER: a file touched when the suite began
set -u
marker=${1:-}
status=0
left=$(ls /dev/shm 2>/dev/null | grep -i gradagg || true)
if [ -n "$left" ]; then echo "left in /dev/shm: $left"; status=1; fi
if [ -n "$marker" ] && [ -e "$marker" ]; then
  # gradagg-cluster is tests/cluster/cluster.sh's state directory: it stays.
  dirs=$(find "${TMPDIR:-/tmp}" -maxdepth 1 -name 'gradagg-*' -newer "$marker" \
           ! -name gradagg-cluster 2>/dev/null)
  if [ -n "$dirs" ]; then echo "temporary directories left:"; echo "$dirs"; status=1; fi
fi
# Live ones only: an orphan that has exited (a zombie) is init's to reap, which
# on this machine takes a second or two.
procs=""
for name in gradagg_tests gradagg_alloc_t gradagg_core_te linear_regressi consumer \
            gradagg-bench fashion_tests fashion_mnist population_soft population_test; do
  for pid in $(pgrep -x "$name"); do
    case "$(ps -o stat= -p "$pid" 2>/dev/null)" in
      Z* | "") ;;
      *) procs="$procs$(ps -o pid=,args= -p "$pid")"$'\n' ;;
    esac
  done
done
if [ -n "$procs" ]; then echo "processes still running:"; echo "$procs"; status=1; fi
[ $status = 0 ] && echo "no leftovers: /dev/shm clean, no worker processes, no temporary directories"
exit $status
