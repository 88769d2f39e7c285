# One image for every k8s-dispatch process: worker (the default command), beat, Flower and
# the one-shot `k8s-dispatch migrate`. Compose and deploy/ choose the process by command.

# Stage 1: build the package's wheel, so the final image holds the installed package and
# none of the working tree.
FROM python:3.12-slim AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

# Stage 2: the runtime image.
FROM python:3.12-slim

# Logs straight to stdout (no buffering), no .pyc files on a read-only root filesystem,
# no pip cache or version check in the layers.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# A fixed numeric uid/gid (10001, also named in deploy/): Kubernetes' runAsNonRoot can only
# verify a numeric USER.
RUN groupadd --system --gid 10001 k8s-dispatch \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin k8s-dispatch

# Runtime dependencies first, exactly as locked (versions and hashes: `make lock` writes the
# file from pyproject's ranges), so a code change does not reinstall them (this layer is cached
# until the lock changes). No test extra. Every dependency ships manylinux wheels: no compiler.
COPY requirements.lock /tmp/requirements.lock
RUN pip install --require-hashes -r /tmp/requirements.lock && rm /tmp/requirements.lock

# The package itself, without resolving anything again: its dependencies are the locked ones.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels

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
