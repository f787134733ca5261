# raycheck: `make run` runs the main job on the embedded default; `make test` type-checks the packages (mypy) and runs the tests; `make docs` builds the documentation site.
VENV := .venv
STAMP := $(VENV)/.installed
RUN_ARGS ?= --model smollm2-135m --steps 50 --fail 20:worker --fail 30:shadow --fail 40:both --snapshot-policy adaptive --mtbf 10min --verify --overwrite --out runs/default

.PHONY: setup run test docs bench experiment experiment-quick mutate

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/raycheck run $(RUN_ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m mypy
	$(VENV)/bin/python -m pytest -q --durations=25

# The documentation site (mkdocs.yml): the generated reference pages written from the code, then a strict build into site/.
docs: $(STAMP)
	$(VENV)/bin/python docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Mutation check of the core (not part of `make test`; about 30 min on 2 loaded cores, see docs/testing.md).
# Settings in pyproject.toml [tool.mutmut]; MUTANTS='raycheck.training.zo.*' limits it to matching mutants.
MUTANTS ?=
mutate: $(STAMP)
	rm -rf mutants
	env -u PYTHONPATH nice -n 10 $(VENV)/bin/mutmut run --max-children 2 $(MUTANTS)
	env -u PYTHONPATH $(VENV)/bin/mutmut results --all true | $(VENV)/bin/python scripts/mutation_score.py

bench: $(STAMP)
	$(VENV)/bin/python -m raycheck.experiments.log_cost
	$(VENV)/bin/python -m raycheck.experiments.persist_throughput
	$(VENV)/bin/python -m raycheck.experiments.hotpath_bench
	$(VENV)/bin/python -m raycheck.experiments.durability_bench --snapshot-load

experiment: $(STAMP)
	$(VENV)/bin/raycheck experiment --overwrite --out runs/experiment

experiment-quick: $(STAMP)
	$(VENV)/bin/raycheck experiment --quick --overwrite --out runs/experiment-quick
