#!/bin/sh
# Training throughput of fashion_mnist: gradagg with W workers (batch 32 each)
# against the same model trained in one process with batch 32 * W, for W = 1 2 4.
# Each configuration runs REPS times, interleaved, one epoch of all 60,000
# samples; samples/s counts the training steps only (not the test evaluation).
# Every process runs one intra-op thread (FLAGS, default --threads 1).
#   examples/fashion_mnist_bench.sh [build/examples/fashion_mnist] [REPS]
set -eu
bin=${1:-build/examples/fashion_mnist}
reps=${2:-5}
flags=${FLAGS---threads 1}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

for rep in $(seq "$reps"); do
  for w in 1 2 4; do
    for mode in gradagg single; do
      flag=""; [ "$mode" = single ] && flag=--single
      "$bin" $flag $flags --workers "$w" --epochs 1 --metrics "$out/$mode-$w.csv" > /dev/null
    done
  done
done

# CSV column 7 is samples/s; the first line is the header.
stats() { tail -n +2 "$1" | cut -d, -f7 | sort -n | awk '{ v[NR] = $1 }
  END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        printf "%.0f (%.0f-%.0f)", m, v[1], v[NR] }'; }
median() { tail -n +2 "$1" | cut -d, -f7 | sort -n | awk '{ v[NR] = $1 }
  END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "| workers x batch | gradagg samples/s | one process, batch | one process samples/s | gradagg / one process |"
echo "|---|---|---|---|---|"
for w in 1 2 4; do
  g=$(median "$out/gradagg-$w.csv"); s=$(median "$out/single-$w.csv")
  echo "| $w x 32 | $(stats "$out/gradagg-$w.csv") | $((32 * w)) | $(stats "$out/single-$w.csv") | $(awk -v g="$g" -v s="$s" 'BEGIN { printf "%.2f", g / s }') |"
done
echo
echo "median (min-max) of $reps one-epoch runs, flags: $flags; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; load average now $(cut -d' ' -f1-3 /proc/loadavg)"
