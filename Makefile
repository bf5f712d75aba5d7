# ferry: make demo (the main job), make test (what CI runs).
SHELL := /bin/bash
export PATH := $(PATH):/usr/local/go/bin
GO ?= go
BIN := bin
GOTEST := $(GO) test -count=1 -timeout 15m

.PHONY: all deps build alloc demo test vet unit e2e test-python test-mooncake-real test-mooncake-real-rdma test-rdma bench-rdma fuzz fuzz-smoke soak bench install deb test-deb test-systemd clean gpu-bundle test-gpu

# The version every build carries (ferryd --version, GET /v1/status) and the
# package is named by: git describe made a Debian version (scripts/version.sh
# gives the rule). make VERSION=... overrides it on the command line; a
# VERSION in the environment does not (it may mean anything there).
VERSION := $(shell scripts/version.sh)
VERSION_LDFLAGS := -X github.com/ferry-project/ferry/daemon.Version=$(VERSION)
# More linker flags for make build, e.g. EXTRA_LDFLAGS='-s -w' to strip.
EXTRA_LDFLAGS ?=

all: build

# Installs what a fresh Debian machine lacks (apt, as root); a no-op when present.
deps:
	@scripts/deps.sh

build: deps
	$(GO) build -trimpath -ldflags '$(VERSION_LDFLAGS) $(EXTRA_LDFLAGS)' -o $(BIN)/ ./cmd/...

# ferry's preload allocator (python/ferry/alloc, docs/python.md): built
# into the package, which ships it.
ALLOC_SO := python/ferry/alloc/libferry_alloc.so
alloc: $(ALLOC_SO)
$(ALLOC_SO): python/ferry/alloc/ferry_alloc.c
	gcc -O2 -g -fPIC -shared -Wall -Wextra -Werror -o $@ $< -ldl -lpthread

# Two ferryd on loopback: stage a random 16x4096 bf16 embedding, send, verify.
demo: build
	@scripts/demo.sh $(BIN)

vet: deps
	$(GO) vet ./...
	@test -z "$$(gofmt -l .)" || { echo "gofmt would change:"; gofmt -l .; exit 1; }

# Unit and conformance tests, all under the race detector (the packages
# are concurrent throughout).
unit: deps
	$(GO) test -count=1 -race -timeout 15m $$($(GO) list ./... | grep -v /test/)

# Real ferryd processes on loopback and in network namespaces (root), with
# race-built binaries.
e2e: deps
	FERRY_E2E_RACE=1 $(GOTEST) -v ./test/... 2>&1 | scripts/gotest-summary.sh

# The Python package (python/, docs/python.md): installed offline with
# Debian's pip into a throwaway venv that also sees Debian's pytest and
# torch (so the install itself is tested), then its tests against real
# ferryd processes and a Mooncake-protocol peer (test/mcpeer, built
# here). Under a minute on a quiet host, three on a busy one (the
# limit, 900 s, leaves room). python/build goes first: setuptools
# builds there and would ship files the source no longer has.
PYVENV := $(BIN)/python-venv
test-python: build alloc
	@scripts/deps.sh python
	$(GO) build -trimpath -o $(BIN)/ ./test/mcpeer
	rm -rf $(PYVENV) python/build python/ferry.egg-info
	/usr/bin/python3 -m venv --system-site-packages --without-pip $(PYVENV)
	$(PYVENV)/bin/python -m pip install --no-build-isolation --no-index --no-deps --quiet ./python
	cd python/tests && $(PYTEST_ENV) FERRYD=$(CURDIR)/$(BIN)/ferryd MCPEER=$(CURDIR)/$(BIN)/mcpeer timeout 900 $(CURDIR)/$(PYVENV)/bin/python -m pytest -p no:cacheprovider $(or $(PYTEST_ARGS),.)

# ferry's Mooncake engine class against a real Mooncake engine, over TCP,
# both ways (python/tests/test_mooncake_real.py). Opt-in: MOONCAKE_PY is
# what scripts/mooncake-build.sh built (a 15-minute compile CI does not
# carry).
test-mooncake-real: build alloc
	@test -n "$(MOONCAKE_PY)" || { echo "MOONCAKE_PY=dir is needed: build one with scripts/mooncake-build.sh SRC dir"; exit 2; }
	$(MAKE) test-python PYTEST_ARGS="test_mooncake_real.py" PYTEST_ENV="FERRY_TEST_MOONCAKE_PY=$(abspath $(MOONCAKE_PY)) LD_LIBRARY_PATH=$(abspath $(MOONCAKE_PY))"

# test-mooncake-real over RDMA: in the soft-RoCE VM (test/rxevm), two real
# Mooncake engines over rxe, then test_mooncake_real.py with the real
# engines on rxe0 and ferryd --transport rdma on rxe1; the VM's other
# tests and benchmarks left out. Opt-in as test-mooncake-real; 3-8
# minutes here.
test-mooncake-real-rdma: deps
	@test -n "$(MOONCAKE_PY)" || { echo "MOONCAKE_PY=dir is needed: build one with scripts/mooncake-build.sh SRC dir"; exit 2; }
	RXEVM_MOONCAKE_PY=$(abspath $(MOONCAKE_PY)) RXEVM_RUN='^$$' RXEVM_E2E='^$$' RXEVM_NETEM='^$$' RXEVM_BENCH=0 test/rxevm/run.sh

# The verbs path for real: the rdma package and the RDMA end-to-end tests
# inside a soft-RoCE VM (QEMU TCG, Debian's kernel with rdma_rxe), and the
# netem fault tests over TCP (that kernel has sch_netem), then ferry's RDMA
# writes beside ib_write_bw on the same device (ratio= lines), 5 rounds
# a size (enough to catch a benchmark that errs; bench-rdma runs the full
# rounds whose medians bench/README.md quotes). About 15 minutes; the
# first run downloads the kernel package (~70 MB) into .cache/rxevm.
test-rdma: deps
	RXEVM_ROUNDS=$${RXEVM_ROUNDS:-5} test/rxevm/run.sh

# The soft-RoCE benchmarks alone, with each size's full rounds (25 at
# 64 KiB, 9 above): the figures bench/README.md quotes.
bench-rdma: deps
	RXEVM_RUN='^$$' RXEVM_E2E='^$$' RXEVM_NETEM='^$$' test/rxevm/run.sh


# Every fuzz target for FUZZTIME each; a failing input lands in the
# package's testdata/fuzz/<Target>/ (commit it with its fix).
FUZZTIME ?= 60s
fuzz: deps
	FUZZTIME=$(FUZZTIME) scripts/fuzz.sh

# A few seconds per target, so that CI keeps every target running.
fuzz-smoke: deps
	FUZZTIME=3s scripts/fuzz.sh

test: vet unit fuzz-smoke e2e test-python test-deb test-rdma test-systemd

# 64 clients staging, sending and receiving across two ferryd for
# SOAK_DURATION, then the accounting and leak checks (make test runs it for
# 10 s). Raise SOAK_TIMEOUT with a SOAK_DURATION near or beyond it.
SOAK_DURATION ?= 3m
SOAK_TIMEOUT ?= 1h
soak: deps
	FERRY_SOAK_DURATION=$(SOAK_DURATION) $(GO) test -count=1 -timeout $(SOAK_TIMEOUT) -v -run '^TestSoak$$' ./test/e2e 2>&1 | scripts/gotest-summary.sh

# Binaries, systemd units, sysusers.d/tmpfiles.d entries and the example
# configuration. PREFIX=/usr for a package; DESTDIR stages into a tree. The
# unit's paths follow PREFIX and SYSCONFDIR. An existing ferryd.toml is kept.
PREFIX ?= /usr/local
SYSCONFDIR ?= /etc
DESTDIR ?=
LIBDIR := $(DESTDIR)$(PREFIX)/lib
install: build
	install -d $(DESTDIR)$(PREFIX)/bin $(LIBDIR)/systemd/system $(LIBDIR)/sysusers.d $(LIBDIR)/tmpfiles.d \
		$(DESTDIR)$(PREFIX)/share/doc/ferry $(DESTDIR)$(SYSCONFDIR)/ferry
	install -m 0755 $(addprefix $(BIN)/,ferryd ferryctl ferrybench) $(DESTDIR)$(PREFIX)/bin/
	sed -e 's|/usr/bin/ferryd|$(PREFIX)/bin/ferryd|' -e 's|/etc/ferry/|$(SYSCONFDIR)/ferry/|' \
		systemd/ferryd.service > $(LIBDIR)/systemd/system/ferryd.service
	install -m 0644 systemd/ferryd.socket $(LIBDIR)/systemd/system/
	install -m 0644 systemd/ferry.sysusers $(LIBDIR)/sysusers.d/ferry.conf
	install -m 0644 systemd/ferry.tmpfiles $(LIBDIR)/tmpfiles.d/ferry.conf
	install -m 0644 systemd/ferryd.toml README.md docs/*.md $(DESTDIR)$(PREFIX)/share/doc/ferry/
	test -e $(DESTDIR)$(SYSCONFDIR)/ferry/ferryd.toml || install -m 0644 systemd/ferryd.toml $(DESTDIR)$(SYSCONFDIR)/ferry/
	@echo "installed; then: systemd-sysusers && systemd-tmpfiles --create && systemctl daemon-reload && systemctl enable --now ferryd.socket ferryd.service"

# The Debian package, bin/ferry_<VERSION>_<arch>.deb: what make install
# stages with PREFIX=/usr, stripped and position-independent (ASLR, as
# lintian's hardening checks want), plus the maintainer scripts and
# metadata of packaging/deb (build.sh there says what it adds). The units
# go to /usr/lib/systemd/system: bookworm's lintian takes it as well as
# /lib, later releases want it, and moving a file between the two aliased
# folders in an upgrade can lose it (DEP 17).
DEBDIR := $(BIN)/deb
deb:
	@scripts/deps.sh deb
	rm -rf $(DEBDIR)
	GOFLAGS="$$GOFLAGS -buildmode=pie" $(MAKE) --no-print-directory install BIN=$(DEBDIR)/bin \
		DESTDIR=$(DEBDIR)/debian/ferry PREFIX=/usr EXTRA_LDFLAGS='-s -w'
	packaging/deb/build.sh $(DEBDIR) $(VERSION) $(BIN)

# Builds the package and checks it: lintian, its file list, and install,
# upgrade, remove and purge with dpkg into a scratch root (never this host's).
test-deb: deb
	timeout 600 test/deb/run.sh $(BIN)/ferry_$(VERSION)_$$(dpkg --print-architecture).deb

# The package on a booted Debian 12 with systemd: a QEMU (TCG) guest of
# 4 GiB built from Debian's packages with mmdebstrap (cached in
# .cache/systemdvm), which installs the package, exercises it under systemd
# and reboots, upgrades, removes and purges it; one PASS/FAIL line per
# check (test/systemd/run.sh). Part of make test: about 15 minutes from a
# cold cache (mmdebstrap), 8 warm.
test-systemd: deb
	timeout 2400 test/systemd/run.sh $(BIN)/ferry_$(VERSION)_$$(dpkg --print-architecture).deb

# Everything make test-gpu runs, built here for a GPU host that may lack
# Go: stripped binaries and test binaries plus the scripts. Copy the folder
# there and run test-gpu.sh in it (or make test-gpu).
GPU_BUNDLE := $(BIN)/gpu-bundle
gpu-bundle: deps
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)
	$(GO) build -trimpath -ldflags='-s -w $(VERSION_LDFLAGS)' -o $(GPU_BUNDLE)/ ./cmd/ferryd ./cmd/ferryctl
	$(GO) test -c -ldflags='-s -w' -o $(GPU_BUNDLE)/cuda.test ./cuda
	$(GO) test -c -ldflags='-s -w' -o $(GPU_BUNDLE)/e2e.test ./test/e2e
	cp scripts/gpu/test-gpu.sh scripts/gpu/*.py $(GPU_BUNDLE)/
	cp -r python/ferry $(GPU_BUNDLE)/ && rm -rf $(GPU_BUNDLE)/ferry/__pycache__

# The checks on a real GPU (NVIDIA driver, python3 with torch): builds the
# bundle first where Go is installed.
test-gpu:
	@if command -v $(GO) >/dev/null 2>&1; then $(MAKE) --no-print-directory gpu-bundle; fi
	$(GPU_BUNDLE)/test-gpu.sh

# Benchmarks, never part of make test (which runs only ferrybench's smoke
# test): a short transfer sweep with its plot, the control plane, and the
# side-by-side comparisons with iperf3 and the raw transport write. See
# bench/README.md.
bench: build
	$(BIN)/ferrybench transfer --duration 300ms --plot $(BIN)/bench-transfer.png
	$(BIN)/ferrybench api --duration 1s
	FERRYBENCH=$(BIN)/ferrybench bench/compare-tcp.sh
	FERRYBENCH=$(BIN)/ferrybench bench/compare-raw.sh

clean:
	rm -rf $(BIN) $(ALLOC_SO)
