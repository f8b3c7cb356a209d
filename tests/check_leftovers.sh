#!/usr/bin/env bash
# After the suite: nothing of ours in /dev/shm, no worker process left running.
set -u
status=0
left=$(ls /dev/shm 2>/dev/null | grep -i gradagg || true)
if [ -n "$left" ]; then echo "left in /dev/shm: $left"; status=1; fi
procs=$(pgrep -a -f 'gradagg_tests|linear_regression_parity|tests/package.*/consumer' | grep -v -e pgrep -e check_leftovers || true)
if [ -n "$procs" ]; then echo "processes still running:"; echo "$procs"; status=1; fi
[ $status = 0 ] && echo "no leftovers: /dev/shm clean, no worker processes"
exit $status
