# syntax=docker/dockerfile:1
# One image for every tether role: `tether controlplane serve`, `tether sidecar`, and the agent pod's
# egress lock (`python -m tether.proxy.egress`, which needs the iptables package installed below).
#
#   docker build -t tether:0.1.0 .
#   docker run --rm -p 7000:7000 tether:0.1.0 controlplane serve --listen 0.0.0.0:7000 ...
#
# The image runs as uid 10001 ("tether"). The Kubernetes manifests pin the sidecar to that uid, because the
# egress lock lets exactly that uid leave the pod; only the egress-lock init container runs as root.

ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

# -- build: resolve and install tether and its dependencies into a self-contained virtualenv ----------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/tether
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tether ./tether
RUN /opt/tether/bin/pip install --no-compile . \
    && /opt/tether/bin/python -m compileall -q /opt/tether/lib

# -- runtime ------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tether" \
      org.opencontainers.image.description="Capability-chain sidecars and a control plane that owns termination" \
      org.opencontainers.image.licenses="Apache-2.0"

# iptables: only the egress-lock init container uses it (iptables-nft; iptables-legacy-restore is there too).
RUN apt-get update \
    && apt-get install -y --no-install-recommends iptables=1.8.9-2 \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 tether \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tether --create-home \
       --shell /usr/sbin/nologin tether \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/tether/state /var/lib/tether/state/ca

COPY --from=build /opt/tether /opt/tether

ENV PATH=/opt/tether/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TETHER_HEALTHCHECK_URL=http://127.0.0.1:7000/healthz

WORKDIR /var/lib/tether
USER 10001:10001
EXPOSE 7000 8080

# For the control plane role. Kubernetes ignores HEALTHCHECK: pods use probes (httpGet /healthz for the
# control plane, an exec probe on the sidecar's ready file for sidecars). A sidecar run under plain Docker or
# compose overrides this check or sets TETHER_HEALTHCHECK_URL=none. Proxies from the environment are ignored.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request as u; url = os.environ.get('TETHER_HEALTHCHECK_URL', ''); sys.exit(0) if url in ('', 'none') else u.build_opener(u.ProxyHandler({})).open(url, timeout=4)"]

ENTRYPOINT ["tether"]
CMD ["--help"]
