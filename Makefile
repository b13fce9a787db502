# outbox-relay: `make test` runs the suite (`make test-unit` the tests that need no service),
# `make demo` runs the relay end to end.
# Each target creates the virtual environment it needs (.venv) on first use.

VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-stamp

# Test services: an explicit RELAY_TEST_* wins; otherwise this machine's local
# PostgreSQL and RabbitMQ when they answer; otherwise the tests fall back to
# testcontainers (where a Docker engine answers) or skip with a hint.
answers = $(shell $(PYTHON) -c "import socket; socket.create_connection(('127.0.0.1', $(1)), 1)" 2>/dev/null && echo yes)
ifeq ($(origin RELAY_TEST_DSN), undefined)
  ifeq ($(call answers,5432),yes)
    export RELAY_TEST_DSN := postgresql://postgres@127.0.0.1:5432/test
  endif
endif
ifeq ($(origin RELAY_TEST_AMQP_URL), undefined)
  ifeq ($(call answers,5672),yes)
    export RELAY_TEST_AMQP_URL := amqp://guest:guest@127.0.0.1:5672/
  endif
endif

PYTEST_ARGS ?=
# The database `make run` uses: this machine's local PostgreSQL unless told otherwise.
RUN_DSN ?= postgresql://postgres@127.0.0.1:5432/test
RUN_BROKER ?= log

PHONY_EXAMPLES := example-producer example-consumer
.PHONY: $(PHONY_EXAMPLES) venv bytecode docs docs-reference run test test-unit test-all image wheels image-test test-faults lint format demo bench bench-rabbitmq bench-sqs bench-console soak console-screenshots clean

# Destinations outside the relay's package, installed beside it as a third party's would be
# (each declares itself in the entry-point group outbox_relay.destinations): the suite tests
# that `relay` finds them and that they pass the conformance suite. The wheel holds none.
PLUGINS := tests/plugins/redis_streams

$(STAMP): pyproject.toml $(PLUGINS:%=%/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' $(PLUGINS:%=-e %)
	touch $(STAMP)

venv: $(STAMP)

# The project's own modules compiled ahead: where PYTHONDONTWRITEBYTECODE is set (as on
# this machine), Python never caches what it compiles, and each of the hundreds of
# `relay` processes the tests start would compile them again (a start of `relay` took
# 0.52 s with them compiled, 0.77 s without: medians of 12). Only what changed is
# compiled again, in well under a second.
bytecode: venv
	@$(BIN)/python -m compileall -q relay tests scripts examples

# The whole product in one command: a demo outbox in a database of its own (DEMO_DATABASE,
# created if absent on RUN_DSN's server; RUN_DSN's own database is left alone), producers,
# `relay start --broker sqs` into an embedded SQS FIFO queue, and a consumer's verdict.
DEMO_DATABASE ?= outbox_relay_demo
demo: venv
	$(BIN)/python scripts/demo.py --dsn '$(RUN_DSN)' --database '$(DEMO_DATABASE)'

# The manual (mkdocs.yml, docs/) built into site/, strictly: a broken link or a page left
# out of the navigation fails it. make test builds it too (tests/test_docs_site.py).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# docs/reference/ rewritten from the code: the options, the metrics and the Python API.
# make test fails while a page there is stale (tests/test_docs_reference.py).
docs-reference: venv
	$(BIN)/python scripts/docs_reference.py

# The Python API's examples (examples/README.md), each in a database of its own.
example-producer: venv
	$(BIN)/uvicorn examples.producer:app --port 8000

example-consumer: venv
	$(BIN)/python -m examples.consumer

# Migrate the outbox in RUN_DSN and deliver it to RUN_BROKER until Ctrl-C.
run: venv
	$(BIN)/relay migrate --dsn '$(RUN_DSN)'
	$(BIN)/relay start --dsn '$(RUN_DSN)' --broker $(RUN_BROKER)

# pytest exits 5 when it collected no tests; that is a failure here, never a pass.
# The long scenarios (marker `extended`) run in `make test-all` (and those that are fault
# scenarios in `make test-faults`); here a representative one of each kind keeps the suite
# under 10 minutes on 2 cores.
#
# Two passes: everything that shares nothing with its neighbours on two processes (the
# tests mostly wait on subprocesses, brokers and the database; pytest-xdist), then the
# fault scenarios and the `serial` tests, which stop RabbitMQ
# or kill every relay session in the database, alone. Both must pass.
test: bytecode
	@$(BIN)/pytest -n 2 -m "not extended and not faults and not serial and not image" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	$(BIN)/pytest -m "(faults or serial) and not extended and not image" $(PYTEST_ARGS); rc2=$$?; \
	if [ $$rc2 -eq 5 ]; then echo "make test: pytest collected no fault tests" >&2; exit 1; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$rc2

# The tests that need no service, on two processes, in well under a minute. What needs one
# (PostgreSQL, RabbitMQ, moto, the Kafka-protocol broker, NATS, a second PostgreSQL cluster,
# and every receiver or relay process that writes to one) is marked `integration` by
# tests/conftest.py from the test's fixtures (tests/services.py names the service fixtures),
# so nobody marks a test by hand. No service is looked for: the test variables are cleared
# and a service fixture fails rather than skips, so a unit test that reaches for one fails
# (.ci/run runs this in a network namespace where nothing listens). The image test has its
# own target (image-test).
test-unit: bytecode
	@env -u RELAY_TEST_DSN -u RELAY_TEST_AMQP_URL -u RELAY_TEST_NATS_URL RELAY_TEST_REQUIRE_SERVICES=1 \
	  $(BIN)/pytest -n 2 -m "not integration and not image" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-unit: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The container image (Containerfile): `make image` builds it here with buildah on a
# debootstrap base (root, Debian's buildah and debootstrap; scripts/image.sh), `make wheels`
# makes dist/wheels for a `docker build -f Containerfile .` elsewhere, `make image-test` builds and runs it
# against this machine's PostgreSQL and RabbitMQ (tests/test_image.py; .ci/run runs it).
IMAGE ?= localhost/outbox-relay:latest
image: venv
	bash scripts/image.sh $(IMAGE)

wheels: venv
	rm -rf dist/wheels
	$(BIN)/pip wheel --quiet '.[all,console,otel]' -w dist/wheels

image-test: bytecode
	@$(BIN)/pytest -m image -s tests/test_image.py $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make image-test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Everything, the long scenarios (marker `extended`) included.
test-all: bytecode
	@$(BIN)/pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-all: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The whole fault-injection suite (`make test` runs a representative part); REPEAT=5 runs it 5 times.
REPEAT ?= 1
test-faults: bytecode
	@for i in $$(seq $(REPEAT)); do echo "fault suite, run $$i of $(REPEAT)"; \
	  $(BIN)/pytest -m faults -s $(PYTEST_ARGS) || exit 1; done

# The README's console screenshots: the browser tests, saving each page into docs/console/.
console-screenshots: venv
	RELAY_CONSOLE_SCREENSHOTS=docs/console $(BIN)/pytest tests/test_console_browser.py -q $(PYTEST_ARGS)

# Benchmarks (scripts, not tests): each prints its figures beside a baseline from the same run.
# bench_producer needs pgbench (Debian: postgresql-client); bench_scale and bench_replay need
# RabbitMQ too (BENCH_SCALE_ARGS=--quick, BENCH_REPLAY_ARGS='--messages 5000 --rounds 1' for
# a smoke run).
bench: venv
	$(BIN)/python scripts/bench_loop.py
	$(BIN)/python scripts/bench_db.py
	$(BIN)/python scripts/bench_producer.py
	$(BIN)/python scripts/bench_scale.py $(BENCH_SCALE_ARGS)
	$(BIN)/python scripts/bench_replay.py $(BENCH_REPLAY_ARGS)
	$(BIN)/python scripts/bench_api.py
	$(BIN)/python scripts/bench_http.py
	$(BIN)/python scripts/bench_kafka.py
	$(BIN)/python scripts/bench_nats.py
	@# Exits 1 while the relay is under 0.9x of the minimal relay; the figures are printed either way.
	-$(BIN)/python scripts/bench_rabbitmq.py

bench-rabbitmq: venv
	$(BIN)/python scripts/bench_rabbitmq.py

bench-sqs: venv
	$(BIN)/python scripts/bench_sqs.py

# The console and `relay dead list --group` at a million dead rows, in a database of their
# own (about 5 minutes; BENCH_CONSOLE_ARGS=--rows 100000 for a smoke run).
bench-console: venv
	$(BIN)/python scripts/bench_console.py $(BENCH_CONSOLE_ARGS)

# Producers and relays (one SIGKILLed every 2 minutes, scheduled prune on) for SOAK_MINUTES at
# SOAK_RATE rows/s on a PostgreSQL cluster of its own with autovacuum on: does anything grow?
SOAK_MINUTES ?= 30
SOAK_RATE ?= 1000
soak: venv
	$(BIN)/python scripts/soak.py --minutes $(SOAK_MINUTES) --rate $(SOAK_RATE)

lint: venv
	$(BIN)/ruff check relay tests scripts examples
	$(BIN)/ruff format --check relay tests scripts examples
	$(BIN)/mypy

format: venv
	$(BIN)/ruff check --fix relay tests scripts examples
	$(BIN)/ruff format relay tests scripts examples

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .hypothesis
