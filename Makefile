# millrace: `make demo` shows the outbox at work, `make test` runs every test.
GO      ?= go
PKGS    ?= ./...
STACK   := internal/devstack/stack.sh
CONFIG  ?= config.yaml

.PHONY: help up down status test vet fmt-check lint demo saga migrate bench reliability fuzz

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

up: ## make PostgreSQL, RabbitMQ and NATS reachable locally (reuse, start or install; a current nats-server on 4223 beside an older one), pgbouncer and chromium installed
	@$(STACK) up

down: ## stop what `make up` started, nothing else
	@$(STACK) down

status: ## show which local services answer
	@$(STACK) status

vet:
	$(GO) vet $(PKGS)

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

lint: vet fmt-check ## go vet and gofmt

FAULTS  := ./internal/testing/faults

test: up lint ## every test, unit and integration, with -race, against the local services
	$(GO) test -race -count=1 -timeout 60m $$($(GO) list $(PKGS) | grep -v '/internal/testing/faults$$')
	$(if $(filter ./...,$(PKGS)),$(MAKE) --no-print-directory fuzz FUZZTIME=$(TEST_FUZZTIME))
	@# The fault-injection suite runs many processes of its own: alone, after the rest.
	$(if $(filter ./...,$(PKGS)),$(GO) test -race -count=1 -timeout 60m $(FAULTS))

FUZZTIME      ?= 1m
# make test fuzzes each target for a count of inputs, not a time: with a
# time, Go before 1.27 may fail a target at the deadline while a worker is
# still running an input (golang/go#75804: "context deadline exceeded",
# nothing found). 5000 inputs take 0.2s to 5s per target here.
TEST_FUZZTIME ?= 5000x

fuzz: up ## run every fuzz target for FUZZTIME each (make test: 5000 inputs each)
	@set -e; for file in $$(grep -rl --include='*_test.go' '^func Fuzz' . | sort); do \
		for fn in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$file); do \
			echo "fuzz $$(dirname $$file) $$fn for $(FUZZTIME)"; \
			out=$$($(GO) test -run '^$$' -fuzz "^$$fn$$" -fuzztime $(FUZZTIME) $$(dirname $$file) 2>&1) || \
				{ echo "$$out"; exit 1; }; \
		done; \
	done

migrate: ## create millrace's tables in the database config.yaml names
	@$(STACK) up postgres
	$(GO) run ./cmd/millrace --config $(CONFIG) migrate

BROKER  ?=

demo: ## the seed scenario end to end (BROKER=nats|rabbitmq|kafka; default: config.yaml, in-process NATS; SAGA=1: `make saga`)
ifneq ($(SAGA),)
	@$(MAKE) --no-print-directory saga BROKER=$(BROKER)
else
	@# PostgreSQL always; a broker server only for BROKER=rabbitmq (NATS and Kafka run in process).
	@$(STACK) up postgres $(if $(filter rabbitmq,$(BROKER)),rabbitmq)
	$(if $(BROKER),MILLRACE_BROKER_KIND=$(BROKER)) $(GO) run ./examples/demo --config $(CONFIG)
endif

saga: ## the order saga example: payment, stock, notify, a refund and a timeout (BROKER=nats|rabbitmq|kafka; default nats)
	@# PostgreSQL always; the local RabbitMQ or NATS server (Kafka runs in process).
	@$(STACK) up postgres $(if $(filter kafka,$(BROKER)),,$(if $(filter rabbitmq,$(BROKER)),rabbitmq,nats))
	$(if $(BROKER),MILLRACE_BROKER_KIND=$(BROKER)) $(GO) run ./examples/saga

bench: up ## benchmarks, millrace side by side with stock Watermill and a hand-written reference; rewrites the relay tables of docs/PERFORMANCE.md
	@# BenchmarkRelay alone takes more than go test's default 10-minute timeout.
	MILLRACE_PERFORMANCE_DOC=$(CURDIR)/docs/PERFORMANCE.md $(GO) test -run '^$$' -bench . -benchmem -timeout 60m $(PKGS)

reliability: up ## the fault-injection suite on every broker; rewrites docs/RELIABILITY.md from its results
	MILLRACE_RELIABILITY_DOC=$(CURDIR)/docs/RELIABILITY.md $(GO) test -race -count=1 -timeout 60m -v $(FAULTS)
