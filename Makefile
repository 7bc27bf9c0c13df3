# textgen: set-up, run, test, benchmark. `make install` then `make run` or `make test`.
PYTHON ?= python3
PROTO_OUT ?= proto
MODEL_DIR ?= models/tiny-llama
MODEL_ARCH ?= llama
MODEL_SIZE ?= tiny
PORT ?= 3000

.PHONY: install proto run test test-fast lint bench demo-model image image-test

# torch first and pinned: the CPU wheel; an unpinned torch pulls several GB of CUDA packages. Last, the shard's C++
# ops for this CPU (layers/cpu_ops.py), built here rather than by the first server start or test session that needs
# them (83-87 s on a 2-core Zen 3); where they cannot be built, the shard keeps torch's code.
install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[test]"
	$(MAKE) proto
	$(PYTHON) -c "from textgen_server.layers.cpu_ops import kernel_available; kernel_available()"

# Generated gRPC/protobuf modules: a build output, never edited by hand.
proto: $(PROTO_OUT)/textgen_pb/generate_pb2.py

$(PROTO_OUT)/textgen_pb/generate_pb2.py: proto/v3/generate.proto
	mkdir -p $(PROTO_OUT)/textgen_pb
	$(PYTHON) -m grpc_tools.protoc -Itextgen_pb=proto/v3 --python_out=$(PROTO_OUT) \
		--pyi_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) proto/v3/generate.proto

demo-model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json:
	textgen-server build-test-model $(MODEL_DIR) --arch $(MODEL_ARCH) --size $(MODEL_SIZE)

# Serves the locally built demo model (no hub is reachable here) on http://127.0.0.1:$(PORT).
run: proto demo-model
	textgen-launcher --model-id $(MODEL_DIR) --port $(PORT) --hostname 127.0.0.1

# Two workers (pytest-xdist), a test module on one worker at a time so that its module-scoped processes serve it
# whole: on 2 cores the suite is bound by process starts and model steps, which a second worker overlaps.
TEST_WORKERS ?= 2

test: proto
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# The edit-test loop: every test that starts no process (a test is skipped where it would start one); CI runs `test`.
test-fast: proto
	$(PYTHON) -m pytest -q --no-processes -n $(TEST_WORKERS) --dist loadscope

# Formatting, lint (pyflakes, bugbear, import order, complexity) and types; configured in pyproject.toml.
lint: proto
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

# `make bench QUANTIZE=gptq` (or gptq-8, awq, eetq) times quantized weights against the float model; BENCH_ARGS
# passes benchmark/shard_decode.py's other flags, e.g. BENCH_ARGS="--model-dir models/llama-1b-v1 --batch 1".
QUANTIZE ?=
BENCH_ARGS ?=
bench: proto
	$(PYTHON) benchmark/shard_decode.py $(if $(QUANTIZE),--quantize $(QUANTIZE)) $(BENCH_ARGS)

# The container image (deploy/image.py: docker or podman, a local Debian base where no registry answers); IMAGE_BASE
# and TORCH_INDEX make the CUDA variant (README).
IMAGE ?= localhost/textgen:latest

image:
	$(PYTHON) deploy/image.py --tag $(IMAGE) $(if $(IMAGE_BASE),--base $(IMAGE_BASE)) \
		$(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX))

# The image run as the README says (serve, stream, drain on stop, a second start on the same volume): minutes, so
# not part of `make test`; run it when the Dockerfile, the image or the launcher changes.
image-test: image
	IMAGE=$(IMAGE) $(PYTHON) -m pytest -v -s deploy/image_tests
