# textgen: CPU image by default (python:3.11-slim + the torch CPU wheel).
# CUDA variant: --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#               --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1

# make runs the proto generation; a CUDA base image brings no Python, the slim one does. g++ builds the shard's
# C++ CPU ops for the CPU that runs them, at a shard's first start (server/textgen_server/layers/cpu_ops.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ \
    && if ! command -v python3 >/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-venv; fi \
    && rm -rf /var/lib/apt/lists/*

# A venv (as TGI's image) so that distro-managed Pythons accept pip installs.
RUN python3 -m venv /usr/src/.venv
ENV PATH=/usr/src/.venv/bin:$PATH

# torch first and from its own index: the PyPI wheel would pull several GB of CUDA libraries.
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}

WORKDIR /usr/src/textgen
# The dependencies' layer depends on pyproject.toml alone, so a build after a source change reinstalls textgen
# only (seconds) instead of every package.
COPY pyproject.toml ./
RUN python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md Makefile ./
COPY proto proto
COPY common common
COPY server server
COPY router router
COPY launcher launcher
COPY benchmark benchmark
COPY clients clients
RUN pip install --no-deps -e . && make proto PYTHON=python3

# Like TGI's image: the server listens on 80 inside the container, and HF_HOME is the /data volume, so the hub
# cache is /data/hub, where TGI 2.x and 3.x volumes keep their models. The built CPU ops are kept there too, so a
# restarted container does not compile them again (their names carry the CPU's flags and the sources' hash: a
# volume shared by other CPUs or versions holds one build of each). A read-only /data makes the shard build them
# under /tmp instead (layers/cpu_ops.py). So are the CPU kernel timings a shard measures at its first load
# (layers/measurements.py).
ENV HF_HOME=/data \
    TORCH_EXTENSIONS_DIR=/data/torch_extensions \
    TEXTGEN_CACHE_DIR=/data/textgen \
    PORT=80
VOLUME /data
EXPOSE 80

ENTRYPOINT ["textgen-launcher"]
