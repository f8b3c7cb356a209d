#!/bin/sh
# The Blas tests of gradagg_tests again under every other BLAS this machine has
# (Debian's alternatives: OpenBLAS with OpenMP or pthreads, the reference BLAS),
# chosen with LD_LIBRARY_PATH as a user would; each run checks it got that one
# (GRADAGG_EXPECT_BLAS). Then the warning: exactly one line on the reference
# BLAS, none on a fast one. Skipped (77) when only one BLAS is installed.
#   other_blas_test.sh <gradagg_tests> <linear_regression_parity>
set -u
tests=$1 demo=$2
lib=/usr/lib/x86_64-linux-gnu
warning="gradagg: warning: LibTorch's matrix products run on the reference BLAS"
ran=0
for entry in openblas-openmp:openblas-openmp openblas-pthread:openblas-pthreads blas:reference-sequential; do
  dir=${entry%%:*} want=${entry#*:}
  [ -f "$lib/$dir/libblas.so.3" ] || continue
  path=$lib/$dir
  # The reference BLAS has its LAPACK beside it in lapack/.
  [ "$dir" = blas ] && path=$path:$lib/lapack
  echo "--- under $want ($path)"
  LD_LIBRARY_PATH=$path GRADAGG_EXPECT_BLAS=$want GRADAGG_QUIET_BLAS=1 \
    "$tests" --gtest_filter='Behaviour.*Blas*:Behaviour.ForkAfter*' || exit 1
  out=$(LD_LIBRARY_PATH=$path "$demo" --workers 2 2>&1) || { echo "$out"; echo "demo failed under $want"; exit 1; }
  lines=$(printf '%s\n' "$out" | grep -c "$warning")
  if [ "$want" = reference-sequential ]; then
    [ "$lines" -eq 1 ] || { echo "$out"; echo "expected one warning on the reference BLAS, got $lines"; exit 1; }
    printf '%s\n' "$out" | grep "$warning" | grep -q "apt-get install libopenblas0-openmp" ||
      { echo "the warning does not name the package"; exit 1; }
  else
    [ "$lines" -eq 0 ] || { echo "$out"; echo "a warning under $want"; exit 1; }
  fi
  ran=$((ran + 1))
done
[ "$ran" -ge 2 ] || { echo "only $ran BLAS here: nothing to compare"; exit 77; }
echo "ran under $ran BLAS"
