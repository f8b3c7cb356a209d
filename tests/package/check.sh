#!/usr/bin/env bash
# Builds tests/package against gradagg twice: from the install prefix and from
# the build tree, then runs the consumer each time.
set -euo pipefail
src=$1 build=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$src/tests/package" -B "$work/from-prefix" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DCMAKE_BUILD_TYPE=Release > "$work/from-prefix.log"
cmake --build "$work/from-prefix" >> "$work/from-prefix.log"
"$work/from-prefix/consumer"
cmake -S "$src/tests/package" -B "$work/from-build-tree" -Dgradagg_DIR="$build" \
      -DCMAKE_BUILD_TYPE=Release > "$work/from-build-tree.log"
cmake --build "$work/from-build-tree" >> "$work/from-build-tree.log"
"$work/from-build-tree/consumer"
