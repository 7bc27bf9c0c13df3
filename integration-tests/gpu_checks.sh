#!/usr/bin/env bash
# The GPU checks (issue 41) in one go on a CUDA machine that reaches no package registry, from the repo root:
#
#     integration-tests/gpu_checks.sh wheels            # here, where pip reaches a registry: fills .whl/
#     OUT=/some/dir integration-tests/gpu_checks.sh [STAGE ...]     # there, with .whl/ carried along
#
# Stages, in this order by default: setup, model, tests (integration-tests/test_cuda.py), decode
# (benchmark/gpu_decode.py), step (benchmark/gpu_step.py), static (transformers' static batch of W1), w1
# (benchmark/http_load.py on the 1b model, bf16); w1-graphs64 (W1 with CUDA graphs up to 64 rows) runs only when
# named. Each stage is bounded by its own timeout and logs to $OUT/<stage>.log, so one that hangs or fails leaves
# the others' figures. The packages the GPU machine lacks (or has in other versions than the generated gRPC code
# and the project need) travel as Python 3.12 wheels of this machine's versions; the project itself is installed
# editable without its dependencies.
set -u
OUT=${OUT:-/tmp/textgen-gpu-checks}
mkdir -p "$OUT"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup model tests decode step static w1)
export PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND under a timeout, its output to the console and $OUT/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "== $name (at ${SECONDS}s, limit ${seconds}s): $*"
    timeout -k 10 "$seconds" bash -c "$*" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} at ${SECONDS}s"
}

setup() {
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
        torch.cuda.get_device_name())"
    python3 -c "import textgen_server.servicer, textgen_router.main, textgen_launcher.main; print('imports ok')"
}

model_dir() {
    python3 -c "from testing.models import build_model; print(build_model('llama', '1b'))" | tail -1
}

# What the GPU machine's image lacked or had too old on 2026-11-28 (grpcio 1.84 fails the generated code's check).
WHEELS=(fastapi starlette pydantic pydantic_core typing-inspection annotated-types annotated-doc typing_extensions
    uvicorn httptools opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc
    opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common opentelemetry-proto
    opentelemetry-semantic-conventions googleapis-common-protos jsonschema jsonschema-specifications referencing
    rpds-py llguidance syrupy grpcio protobuf transformers tokenizers)

wheels() {
    local pins
    pins=$(python3 -c "import sys, importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" \
        "${WHEELS[@]}") || return 1
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 -d .whl $pins
}

export -f setup model_dir
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
for name in "${STAGES[@]}"; do
    case $name in
    wheels) wheels || exit 1 ;;
    setup)
        stage setup 120 setup
        [ -d /tmp/site ] && export PYTHONPATH=/tmp/site
        ;;
    model) stage model 180 model_dir ;;
    tests) stage tests 300 python3 -m pytest -v -s -p no:cacheprovider integration-tests/test_cuda.py ;;
    decode) stage decode 240 python3 benchmark/gpu_decode.py --model-dir "$(model_dir)" --runs 2 ;;
    step) stage step 180 python3 benchmark/gpu_step.py --model-dir "$(model_dir)" ;;
    static) stage static 120 python3 benchmark/gpu_decode.py --w1-static --model-dir "$(model_dir)" ;;
    w1) stage w1 180 python3 benchmark/http_load.py --model "$(model_dir)" --dtype bfloat16 --plot "$OUT/w1.png" ;;
    w1-graphs64)  # W1's 64 rows decode from graphs too
        stage w1-graphs64 180 CUDA_GRAPHS=1,2,4,8,16,32,64 python3 benchmark/http_load.py --model "$(model_dir)" \
            --dtype bfloat16 --plot /tmp/w1-graphs64.png ;;
    *) echo "unknown stage $name" && exit 2 ;;
    esac
done
