# gradagg: two commands do all set-up on a fresh Debian 12 machine.
#   make demo   install missing packages (as root), configure, build, run the parity demo
#   make test   the same, then the whole test suite through CTest
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# ON: compiler warnings are errors (CI's release build)
WERROR ?= OFF

# Debian 12 packages the build needs.
#  - libopenblas0-openmp: LibTorch calls whatever libblas.so.3 the system provides,
#    and libtorch-dev alone brings the reference BLAS (one thread, 10-37x slower).
#    The OpenMP build, not the pthreads one: it takes its threads from LibTorch's own
#    setting (at::set_num_threads) and shares LibTorch's libgomp pool, where the
#    pthreads build keeps a second pool of its own (docs/benchmark.md, "The BLAS").
#    Debian's alternatives then point libblas.so.3 at it; libblas3 stays installed
#    beside it (the tests check the warning gradagg logs on it).
#  - ccache: rebuilds, and CI's fresh clones, reuse what was compiled before.
#  - clang-format, clang-tidy: `make format-check` (CI) and `make tidy`.
PACKAGES := cmake g++ make libtorch-dev libboost-dev libfmt-dev libgtest-dev libcli11-dev \
            libgloo-dev libssl-dev nlohmann-json3-dev gnuplot-nox zlib1g-dev dataset-fashion-mnist \
            python3-dev python3-torch pybind11-dev python3-pytest python3-setuptools python3-pip \
            python3-venv libopenblas0-openmp libblas3 liblapack3 ccache clang-format clang-tidy

.PHONY: all deps configure build demo test test-asan test-tsan bench install clean format format-check tidy

all: build

deps:
	@missing=""; \
	for p in $(PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "gradagg: installing$$missing"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing || exit 1; \
	  else \
	    echo "gradagg: missing Debian packages; run:"; \
	    echo "  sudo apt-get update && sudo apt-get install -y$$missing"; \
	    exit 1; \
	  fi; \
	fi

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DGRADAGG_WERROR=$(WERROR) $(CMAKE_FLAGS)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target linear_regression_parity
	$(BUILD)/examples/linear_regression_parity
	@if grep -q "GRADAGG_BUILD_PYTHON:BOOL=ON" $(BUILD)/CMakeCache.txt; then \
	  cmake --build $(BUILD) -j $(JOBS) --target gradagg_python && \
	  echo "--- the same demo in Python (python/examples/linear_regression_parity.py):" && \
	  PYTHONPATH=$(BUILD)/python /usr/bin/python3 python/examples/linear_regression_parity.py; \
	fi

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

# Every configuration side by side (a few minutes), then bench/speedup.png.
bench: build
	$(BUILD)/bench/gradagg-bench --json $(BUILD)/bench.jsonl
	bench/plot.sh $(BUILD)/bench.jsonl bench/speedup.png

# The suite again under AddressSanitizer + UndefinedBehaviorSanitizer, in build-asan/.
test-asan: deps
	$(MAKE) BUILD=build-asan BUILD_TYPE=RelWithDebInfo WERROR=OFF \
	  CMAKE_FLAGS="-DGRADAGG_SANITIZE=address -DGRADAGG_BUILD_BENCH=OFF -DGRADAGG_BUILD_PYTHON=OFF" test

# The tests labelled `threads` (tests/CMakeLists.txt: those that exercise
# gradagg's threads) under ThreadSanitizer, in build-tsan/; only their
# executables are built. tests/tsan.supp says why each report it suppresses is
# not gradagg's. One test at a time: under TSan a few of them (stop signals,
# waits with deadlines) leave little room for a second suite beside them.
TSAN_TARGETS := gradagg_core_tests gradagg_tests checkpoint_tests gradagg_data_tests
test-tsan: deps
	$(MAKE) BUILD=build-tsan BUILD_TYPE=RelWithDebInfo WERROR=OFF configure \
	  CMAKE_FLAGS="-DGRADAGG_SANITIZE=thread -DGRADAGG_BUILD_BENCH=OFF -DGRADAGG_BUILD_PYTHON=OFF \
	  -DGRADAGG_BUILD_EXAMPLES=OFF"
	cmake --build build-tsan -j $(JOBS) --target $(TSAN_TARGETS)
	cd build-tsan && ctest --output-on-failure -j 1 --timeout 600 -L threads

# Fashion-MNIST (examples/fashion_mnist.cpp): 5 epochs with 2 workers and the same
# model in one process (about a minute on 2 cores), then examples/fashion_mnist.png.
FASHION_FLAGS ?= --workers 2 --epochs 5
.PHONY: plot
plot: configure
	cmake --build $(BUILD) -j $(JOBS) --target fashion_mnist
	rm -f $(BUILD)/fashion_mnist.csv $(BUILD)/fashion_mnist_single.csv
	$(BUILD)/examples/fashion_mnist $(FASHION_FLAGS) --metrics $(BUILD)/fashion_mnist.csv
	$(BUILD)/examples/fashion_mnist $(FASHION_FLAGS) --single --metrics $(BUILD)/fashion_mnist_single.csv
	gnuplot -e "gradagg='$(BUILD)/fashion_mnist.csv'; single='$(BUILD)/fashion_mnist_single.csv'; \
	  out='examples/fashion_mnist.png'" examples/fashion_mnist.gp
	@echo "wrote examples/fashion_mnist.png"

# The library, headers and CMake package under CMAKE_INSTALL_PREFIX (/usr/local), and
# the Python package where Debian's python3 finds it (/usr/local/lib/python3.11/dist-packages).
install: build
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD)

# The style (.clang-format) over every C++ file in git: `format` applies it,
# `format-check` prints each difference and fails on one (CI runs it first).
CXX_FILES = $(shell git ls-files '*.cpp' '*.h')
format: deps
	@clang-format -i $(CXX_FILES) && echo "gradagg: formatted $(words $(CXX_FILES)) files"
format-check: deps
	@clang-format --dry-run --Werror $(CXX_FILES) && echo "gradagg: $(words $(CXX_FILES)) files formatted as .clang-format says"

# clang-tidy (.clang-tidy: bugprone-, performance-, concurrency-; each check
# left off says why) over the library's sources, with the compile commands of a
# configure-only tree ($(BUILD)-tidy). TIDY_FILES narrows it: CI gives the
# src/ files the last commit changed. Fails on any finding.
TIDY_FILES ?= $(shell git ls-files 'src/*.cpp')
tidy: deps
	@cmake -S . -B $(BUILD)-tidy -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
	  -DGRADAGG_BUILD_TESTS=OFF -DGRADAGG_BUILD_EXAMPLES=OFF -DGRADAGG_BUILD_BENCH=OFF \
	  -DGRADAGG_BUILD_PYTHON=OFF > /dev/null
	@echo "gradagg: clang-tidy over $(words $(TIDY_FILES)) files"
	@printf '%s\n' $(TIDY_FILES) | xargs -r -P $(JOBS) -n 1 clang-tidy -p $(BUILD)-tidy --quiet
