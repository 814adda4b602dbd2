# The two commands a newcomer needs:
#   make serve   creates .venv, installs, serves examples/models on http://127.0.0.1:8000
#   make test    creates .venv if needed, starts RabbitMQ, Redis and PostgreSQL if needed, runs
#                the whole suite
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: serve test lint bench bench-peers sim grpc-proto

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*; touch $@

serve: $(STAMP)
	$(VENV)/bin/modelfleet serve --repo examples/models

# Bytecode is cached (__pycache__) even where the shell says PYTHONDONTWRITEBYTECODE: the
# tests start hundreds of modelfleet processes, and each compiled all it imported (~0.4 s
# of CPU). The second pytest collects only the modules that mark a test serial (collecting
# all of them takes ~10 s).
test: $(STAMP)
	bash .ci/rabbitmq-up || test "$$CI" != "true"
	bash .ci/tools-up || test "$$CI" != "true"
	bash .ci/redis-up || test "$$CI" != "true"
	bash .ci/postgres-up || test "$$CI" != "true"
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile \
		-m 'not serial' --durations=15
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/python -m pytest -q -m serial \
		$$(grep -rl --include='test_*.py' 'mark.serial' tests)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/mypy src/modelfleet

bench: $(STAMP)
	$(VENV)/bin/python bench/latency.py
	$(VENV)/bin/python bench/cache_policy.py

# modelfleet against plain uvicorn, MLServer and Ray Serve on one generated catalog (about
# 12 minutes; builds the peers' venvs under bench/peers/.venvs on first use). ARGS=--quick
bench-peers: $(STAMP)
	$(VENV)/bin/python bench/peers/run.py $(ARGS)

sim: $(STAMP)
	$(VENV)/bin/modelfleet sim

# The gRPC messages (src/modelfleet/gateway/grpc_api/inference.proto) -> inference_pb2.py(i)
grpc-proto: $(STAMP)
	cd src && ../$(VENV)/bin/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
		modelfleet/gateway/grpc_api/inference.proto
