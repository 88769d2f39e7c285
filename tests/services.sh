#!/usr/bin/env bash
# Make sure the PostgreSQL, Redis and tools that the tests need are there: start them when they
# are installed but stopped, install them from Debian's packages when missing (root only).
# Idempotent: on a machine where both already run it only checks them.
set -euo pipefail

PG_HOST=127.0.0.1 PG_PORT=5432 REDIS_PORT=6379

log() { echo "services: $*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
wait_for() { # wait_for DESCRIPTION COMMAND...: poll up to 30 s
    local what=$1; shift
    for _ in $(seq 1 60); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
    log "$what did not come up"; return 1
}

apt_updated=0
apt_install() {
    [ "$apt_updated" = 1 ] || { as_root apt-get update -qq; apt_updated=1; }
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

pg_up() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT"; }
pg_login() { psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -Atc 'select 1' ; }

ensure_postgres() {
    if command -v pg_isready >/dev/null && pg_up && pg_login >/dev/null 2>&1; then
        log "postgresql ok"; return
    fi
    if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
        log "installing postgresql"; apt_install postgresql postgresql-client
    fi
    local version; version=$(ls /etc/postgresql | sort -V | tail -n 1)
    # A fresh cluster (ours, or one the image came with) asks for passwords on TCP; the tests
    # connect as postgres with trust on loopback only, as the CI machine is set up.
    local hba=/etc/postgresql/$version/main/pg_hba.conf
    if as_root grep -qE '^host\s+all\s+all\s+(127\.0\.0\.1/32|::1/128)\s+(md5|scram-sha-256|password)' "$hba"; then
        log "postgresql: trust on loopback"
        as_root sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
        pg_up && as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload || true
    fi
    if ! pg_up; then
        log "starting postgresql $version"
        as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    fi
    wait_for "postgresql" pg_up
    wait_for "postgresql login as postgres" pg_login
    log "postgresql ok"
}

redis_up() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping | grep -q PONG; }

ensure_redis() {
    if command -v redis-cli >/dev/null && redis_up; then log "redis ok"; return; fi
    command -v redis-server >/dev/null || { log "installing redis"; apt_install redis-server redis-tools; }
    log "starting redis"
    as_root mkdir -p /var/lib/redis /var/log/redis
    as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" --save "" \
        --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_for "redis" redis_up
    log "redis ok"
}

ensure_tools() {
    # localcluster makes its TLS certificate with openssl (kubectl sends bearer tokens only
    # over https); kubectl itself is needed by the kubectl tests.
    command -v openssl >/dev/null || { log "installing openssl"; apt_install openssl; }
    command -v kubectl >/dev/null || log "WARNING: kubectl is not installed: the kubectl tests will fail"
    # faketime runs a worker with its clock skewed (tests/tasks/test_clock_skew.py).
    command -v faketime >/dev/null || { log "installing faketime"; apt_install faketime; }
    # Headless Chromium and its WebDriver open Flower as a person does (tests/ops/test_flower_browser.py).
    { command -v chromium >/dev/null && command -v chromedriver >/dev/null; } ||
        { log "installing chromium"; apt_install chromium chromium-driver; }
}

ensure_tools
ensure_postgres
ensure_redis
