# Sourced by the examples' shell tests: the dataset they need (skip, exit 77,
# without it) and a work directory removed on exit.
#   need_fashion_data DIR; make_work_dir TAG   (sets $work)
need_fashion_data() {
  if [ ! -e "$1/train-images-idx3-ubyte.gz" ] && [ ! -e "$1/train-images-idx3-ubyte" ]; then
    echo "skipped: no Fashion-MNIST in $1 (Debian's dataset-fashion-mnist)"
    exit 77
  fi
}
make_work_dir() {
  work=$(mktemp -d "${TMPDIR:-/tmp}/gradagg-$1-XXXXXX")
  trap 'pkill -KILL -f "$work" 2>/dev/null; rm -rf "$work"' EXIT
}
