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
# The Python package, where make install put it (when the module was built).
for site in "$work"/prefix/lib/python3*/dist-packages; do
  [ -d "$site/gradagg" ] || continue
  (cd "$work" && PYTHONPATH="$site" /usr/bin/python3 -c '
import torch, gradagg
model = torch.nn.Linear(1, 1)
with gradagg.Aggregator(model, lambda ctx: model(torch.ones(2, 1)).sum(), workers=2) as agg:
    agg.step()
assert gradagg.__file__.startswith("'"$site"'"), gradagg.__file__
print("python package from", gradagg.__file__)
')
done
