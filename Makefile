# ferry: make demo (the main job), make test (what CI runs).
SHELL := /bin/bash
export PATH := $(PATH):/usr/local/go/bin
GO ?= go
BIN := bin
GOTEST := $(GO) test -count=1 -timeout 15m

.PHONY: all deps build demo test vet unit e2e test-rdma bench-tcp clean

all: build

# Installs what a fresh Debian machine lacks (apt, as root); a no-op when present.
deps:
	@scripts/deps.sh

build: deps
	$(GO) build -o $(BIN)/ ./cmd/...

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

# The verbs path for real: the rdma package and the RDMA end-to-end tests
# inside a soft-RoCE VM (QEMU TCG, Debian's kernel with rdma_rxe), then
# ferry's RDMA writes beside ib_write_bw on the same device (ratio= lines).
# About 3-5 minutes; the first run downloads the kernel package (~70 MB)
# into .cache/rxevm.
test-rdma: deps
	test/rxevm/run.sh

test: vet unit e2e test-rdma

clean:
	rm -rf $(BIN)
