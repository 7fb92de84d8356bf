# OrthoRL training image: CUDA 13 runtime, CPython 3.12, the locked GPU stack, `orthojob` as
# entrypoint, a non-root user. Build and push (see docs/deploy.md):
#   docker build --platform linux/amd64 --build-arg GIT_COMMIT="$(git rev-parse HEAD)" -t REGISTRY/orthorl/train:TAG .
# The lock is for Linux x86_64 (hence --platform on other hosts). Measured with a stand-in base
# (`make image-check` prints these): about 4.7 GB downloaded, about 21 GB of disk at the peak of the
# build, a 10.9 GB image plus the CUDA base.
# No `# syntax=` line: BuildKit would pull a frontend image for it, and the legacy builder needs none.
# No secret enters any layer: credentials come at run time from the Kubernetes Secret.
#
# Batch job image: Kubernetes ignores HEALTHCHECK and a Job's pod is watched by its exit code,
# activeDeadlineSeconds and the podFailurePolicy (k8s/grpo-job.yaml), not by a probe.
# checkov:skip=CKV_DOCKER_7:FROM ${BASE_IMAGE} is not resolved by checkov; the ARG's default is the versioned tag 13.0.1-runtime-ubuntu24.04 and a digest is passed at build time
# checkov:skip=CKV_DOCKER_2:batch training job; Kubernetes ignores HEALTHCHECK, the Job's exit code and deadline are the health signal
# The base: pin it by digest at build time (--build-arg BASE_IMAGE=nvidia/cuda:...@sha256:...);
# the tag is the default because a digest cannot be checked without a registry.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.12 (the lock's), and gcc + Python headers: Triton compiles its CUDA launcher stubs at
# run time (Unsloth and vLLM kernels). Versions come from the pinned Ubuntu 24.04 base; apt pins
# would break on every Ubuntu security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

# Dependencies before the code: this layer changes only with the lock. Every wheel is pinned and
# hash-checked, dependencies included (the lock is closed, scripts/check_lock.py); --no-deps because
# the lock leaves out on purpose what cannot load beside its torch (xformers, which Unsloth declares;
# pyproject's [tool.uv] overrides) and pip would fetch it; --only-binary because the lock is
# resolved with --no-build.
COPY requirements/pip.lock requirements/gpu.lock /tmp/
RUN pip install --require-hashes --only-binary=:all: --no-deps -r /tmp/pip.lock \
    && pip install --require-hashes --only-binary=:all: --no-deps -r /tmp/gpu.lock \
    && rm /tmp/pip.lock /tmp/gpu.lock

# The non-root user; writable places for a read-only root filesystem (k8s mounts volumes there: /cache is the model-cache PVC).
RUN groupadd --system --gid 10001 orthorl \
    && useradd --system --uid 10001 --gid orthorl --home-dir /home/orthorl --create-home \
        --shell /usr/sbin/nologin orthorl \
    && mkdir -p /cache /work \
    && chown orthorl:orthorl /cache /work

ENV HOME=/home/orthorl \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    ORTHORL_MODEL_CACHE=/cache/orthorl/models \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    VLLM_CACHE_ROOT=/cache/vllm \
    MPLCONFIGDIR=/cache/matplotlib \
    TMPDIR=/tmp

# The code last. setuptools comes from the lock, so the build needs nothing unpinned.
WORKDIR /opt/orthorl
COPY pyproject.toml README.md ./
COPY server ./server
COPY orthojob ./orthojob
# the accelerate/FSDP config of the multi-node TrainJob (k8s/multinode/trainjob.yaml)
COPY k8s/config ./config
RUN pip install --no-deps --no-build-isolation --no-compile . \
    && rm -rf build ./*.egg-info

ARG GIT_COMMIT=unknown
ENV GIT_COMMIT=${GIT_COMMIT}

# numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd
USER 10001:10001
WORKDIR /work
ENTRYPOINT ["orthojob"]
CMD ["--help"]
