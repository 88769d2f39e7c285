# One image for every k8s-dispatch process: worker (the default command), beat, Flower and
# the one-shot `k8s-dispatch migrate`. Compose and deploy/ choose the process by command.
#
# The same image tools/image.py assembles without Docker (`make image`, what the tests run on the
# real node): Debian bookworm's python3.11 from Debian's own packages, a virtualenv at /opt/venv
# with exactly requirements.lock and the package, unchecked-hash bytecode, user 10001, the same
# environment and command. tests/deploy/test_image.py holds the two to each other.

# Stage 1: the virtualenv, built with pip and the package's wheel, which the final image leaves out.
FROM debian:bookworm-slim AS venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3.11-minimal libpython3.11-stdlib python3.11-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv

# Runtime dependencies first, exactly as locked (versions and hashes: `make lock` writes the
# file from pyproject's ranges), so a code change does not reinstall them (this layer is cached
# until the lock changes). No test extra. Every dependency ships manylinux wheels: no compiler.
COPY requirements.lock /tmp/requirements.lock
RUN pip install --require-hashes -r /tmp/requirements.lock && rm /tmp/requirements.lock

# The package itself, without resolving anything again: its dependencies are the locked ones.
# Then pip goes: the image's virtualenv holds the lock and the package alone.
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --wheel-dir /tmp/wheels . \
 && pip install --no-deps /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /src \
 && pip uninstall --yes pip setuptools

# Stage 2: the runtime image: Debian's interpreter, its standard library, time zones, CA
# certificates, /etc/services, and dash as /bin/sh (the chart's probes are shell one-liners).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install --yes --no-install-recommends \
      python3.11-minimal libpython3.11-stdlib tzdata dash netbase ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid/gid (10001, also named in deploy/): Kubernetes' runAsNonRoot can only
# verify a numeric USER.
RUN groupadd --system --gid 10001 k8s-dispatch \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin k8s-dispatch

COPY --from=venv /opt/venv /opt/venv

# Bytecode for everything a process imports, checked by no timestamp: on a read-only root
# filesystem a process would otherwise compile it all at every start.
RUN python3.11 -m compileall -q --invalidation-mode unchecked-hash /usr/lib/python3.11 /opt/venv/lib

# Logs straight to stdout (no buffering), no .pyc files written at runtime; the venv first on PATH.
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    VIRTUAL_ENV=/opt/venv \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# A working directory of the app's own. Nothing is written at runtime but temp files; in
# Kubernetes the root filesystem is read-only and /tmp an emptyDir.
WORKDIR /app
RUN chown k8s-dispatch:k8s-dispatch /app
USER 10001:10001

# Workers serve Prometheus metrics on 9808 when K8S_DISPATCH_METRICS_PORT=9808; Flower's UI on 5555.
EXPOSE 9808 5555

# SIGTERM starts Celery's warm shutdown: running tasks finish, then the process exits.
STOPSIGNAL SIGTERM
CMD ["celery", "-A", "k8s_dispatch.tasks", "worker", "--loglevel=INFO"]
