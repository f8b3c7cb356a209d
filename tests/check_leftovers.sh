#!/usr/bin/env bash
# After the suite: nothing of ours in /dev/shm, no worker process left running.
# Workers are forks of the test programs, so they carry their names (15 chars).
set -u
status=0
left=$(ls /dev/shm 2>/dev/null | grep -i gradagg || true)
if [ -n "$left" ]; then echo "left in /dev/shm: $left"; status=1; fi
procs=""
for name in gradagg_tests gradagg_alloc_t gradagg_core_te linear_regressi consumer \
            gradagg-bench fashion_tests fashion_mnist population_soft population_test; do
  procs="$procs$(pgrep -a -x "$name")"
done
if [ -n "$procs" ]; then echo "processes still running:"; echo "$procs"; status=1; fi
[ $status = 0 ] && echo "no leftovers: /dev/shm clean, no worker processes"
exit $status
