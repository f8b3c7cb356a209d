#!/bin/sh
# Plots speedup vs single process against parameter count from gradagg-bench's
# JSON Lines:   bench/plot.sh build/bench.jsonl bench/speedup.png
# Needs gnuplot (gnuplot-nox) and awk; no JSON tool: gradagg-bench writes one
# flat object per line, and the fields read here are numbers or plain strings.
set -eu
in=${1:?usage: plot.sh BENCH.jsonl OUT.png}
out=${2:?usage: plot.sh BENCH.jsonl OUT.png}
here=$(cd "$(dirname "$0")" && pwd)
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT

awk -v dir="$data" '
  function field(key,   m) {
    if (!match($0, "\"" key "\":(\"[^\"]*\"|[^,}]*)")) return ""
    m = substr($0, RSTART + length(key) + 3, RLENGTH - length(key) - 3)
    gsub(/"/, "", m)
    return m
  }
  {
    mode = field("mode"); s = field("speedup_vs_single")
    if (mode != "single" && mode != "single-kept" && mode != "ceiling" && mode != "shm" && mode != "gloo") next
    if (s == "" || s == "null") next
    print field("params"), s, field("model") > (dir "/" mode ".dat")
    if (title == "") title = field("cpu") ", " field("cores") " cores, " field("blas_vendor") " (" field("blas_threading") "), " field("optimizer")
    if (mode != "single") workers = field("workers")
  }
  END { print title > (dir "/title"); print workers > (dir "/workers") }
' "$in"

for mode in single single-kept ceiling shm gloo; do
  [ -f "$data/$mode.dat" ] || : > "$data/$mode.dat"
  sort -n "$data/$mode.dat" -o "$data/$mode.dat"
done
gnuplot -e "data='$data'; out='$out'; machine='$(cat "$data/title")'; workers='$(cat "$data/workers")'" \
  "$here/plot.gp"
echo "wrote $out"
