#!/usr/bin/env bash
# pip install --no-build-isolation . into a fresh venv (--system-site-packages: Debian's torch),
# offline; then the package from the venv trains the parity demo, pip shows its version (the
# CMake project's), and pip uninstall leaves none of its files. Skipped (77) without venv or pip.
set -euo pipefail
src=$1 work=$2 version=$3
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || { echo "no python3-venv: skipped"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
py="$work/venv/bin/python"
start=$(date +%s)
GRADAGG_PIP_BUILD_DIR="$work/cmake" "$py" -m pip install --no-build-isolation --no-index \
  --no-cache-dir -q "$src" > "$work/pip-install.log" 2>&1 || { tail -40 "$work/pip-install.log"; exit 1; }
echo "pip install took $(( $(date +%s) - start )) s"
shown=$("$py" -m pip show gradagg | sed -n 's/^Version: //p')
[ "$shown" = "$version" ] || { echo "pip show: version '$shown', CMake's is '$version'"; exit 1; }
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
(cd "$work" && "$py" - "$site" "$version" <<'PY'
import sys, torch, gradagg
site, version = sys.argv[1], sys.argv[2]
assert gradagg.__file__.startswith(site), gradagg.__file__
assert gradagg.__version__ == version, gradagg.__version__
assert hasattr(gradagg.data, "ShardedBatches")
model = torch.nn.Linear(1, 1)
with gradagg.Aggregator(model, lambda ctx: model(torch.ones(2, 1)).sum(), workers=2) as agg:
    agg.step()
assert model.weight.grad is not None
print("gradagg", gradagg.__version__, "from", gradagg.__file__)
PY
)
"$py" "$src/python/examples/linear_regression_parity.py" | tail -1
"$py" -m pip uninstall -y -q gradagg
left=$(find "$site" -maxdepth 1 -iname 'gradagg*' | tr '\n' ' ')
[ -z "$left" ] || { echo "left after pip uninstall: $left"; exit 1; }
"$py" -c 'import gradagg' 2>/dev/null && { echo "gradagg still importable after uninstall"; exit 1; }
echo "installed, shown as $version, trained, uninstalled"
