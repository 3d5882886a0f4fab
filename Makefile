# The two commands a new user needs:
#   make run    bring up the emulated cluster and run the guarded training job (the demo)
#   make test   run the test suite: lint, unit tests and the shared end-to-end tier (what CI runs)
# make test-all adds the end-to-end scenarios marked `full` (before a release; about 50 minutes on 2 cores).
# Both create or refresh ./.venv first (scripts/venv.sh).

VENV := .venv
BIN  := $(VENV)/bin
ARGS ?=

.PHONY: venv run test test-all test-fast test-scaleout lint bench down clean

venv:
	@./scripts/venv.sh

run: venv
	$(BIN)/trainguard demo $(ARGS)

test: venv
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not full" $(ARGS)

test-all: venv
	$(BIN)/ruff check .
	$(BIN)/pytest $(ARGS)

test-fast: venv  # unit tests only: no cluster, no Airflow
	$(BIN)/pytest -m "not slow and not cluster and not airflow" $(ARGS)

lint: venv
	$(BIN)/ruff check .

bench: venv  # hours on 2 cores (chaos.py alone ~33 min); writes bench/results/*.json and the benchmark tables (docs/benchmarks.md, the README's headline)
	$(BIN)/python bench/foundation.py --out bench/results/foundation.json $(ARGS)
	$(BIN)/python bench/detection.py --out bench/results/detection.json $(ARGS)
	$(BIN)/python bench/node_commands.py --out bench/results/node_commands.json $(ARGS)
	$(BIN)/python bench/checkpoint.py --out bench/results/checkpoint.json $(ARGS)
	$(BIN)/python bench/recovery.py --out bench/results/recovery.json $(ARGS)
	$(BIN)/python bench/operations.py --out bench/results/operations.json $(ARGS)
	$(BIN)/python bench/campaign.py --out bench/results/campaign.json $(ARGS)
	$(BIN)/python bench/chaos.py --out bench/results/chaos.json $(ARGS)
	$(BIN)/python bench/simulate.py --out bench/results/simulate.json --chart bench/results/simulate.png $(ARGS)
	$(BIN)/python bench/table.py --update

down: venv
	$(BIN)/trainguard cluster down

clean: down
	rm -rf .tg artifacts

test-scaleout: venv  # the scale-out control plane end to end alone (make test runs it too; 3 to 4 minutes)
	$(BIN)/pytest -m scaleout $(ARGS)
