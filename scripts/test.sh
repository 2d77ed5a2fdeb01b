#!/usr/bin/env bash
# The project's one test command: installs what the tests need, lints, runs pytest.
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest
#   SPEC_TEST_WORKERS=1 bash scripts/test.sh   # one test process (default: 2)
#
# Uses the active virtualenv, or creates .venv in the repository root. On Debian as root it
# apt-installs redis-server (and libopenblas0, an optional speed-up for MLX on the CPU, and
# chromium for the report rendering test); on a Mac it asks you to `brew install redis`.
# It starts no Redis: the tests start a private redis-server on a free port, or use REDIS_URL
# when it is set.
# PYTHON picks the interpreter for a new .venv (default: python3, at least 3.10).
# Written for bash 3.2 too (macOS's /bin/bash).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf '==> %s\n' "$*"; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

os="$(uname -s)"
is_root=false
if [ "$(id -u)" = 0 ]; then is_root=true; fi
can_apt=false
if [ "$os" = Linux ] && $is_root && command -v apt-get >/dev/null 2>&1; then can_apt=true; fi

apt_updated=false
apt_log="$(mktemp)"
added_policy=false
cleanup() {
    rm -f "$apt_log"
    if $added_policy; then rm -f /usr/sbin/policy-rc.d; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# apt_install PKG...: quiet, non-interactive, and without starting any service it installs.
apt_install() {
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        added_policy=true
    fi
    if ! $apt_updated; then
        apt-get update -qq >"$apt_log" 2>&1 || {
            cat "$apt_log" >&2
            return 1
        }
        apt_updated=true
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >"$apt_log" 2>&1 || {
        cat "$apt_log" >&2
        return 1
    }
}

dpkg_has() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# --- system packages -------------------------------------------------------------------
if [ -n "${REDIS_URL:-}" ]; then
    say "REDIS_URL is set: the tests use that Redis"
elif command -v redis-server >/dev/null 2>&1; then
    say "redis-server: $(command -v redis-server)"
elif [ "$os" = Darwin ]; then
    die "redis-server not found; install it with: brew install redis"
elif $can_apt; then
    say "installing redis-server (apt-get)"
    apt_install redis-server || die "apt-get install redis-server failed"
else
    die "redis-server not found; install it (Debian: apt-get install redis-server, as root)"
fi

# tests/test_report.py renders the report page in headless chromium (skipped without it).
if $can_apt && ! command -v chromium >/dev/null 2>&1; then
    say "installing chromium and fonts-dejavu-core (apt-get; for the report rendering test)"
    apt_install chromium fonts-dejavu-core || say "could not install chromium; its test will be skipped"
fi

if $can_apt && ! dpkg_has libopenblas0; then
    say "installing libopenblas0 (optional: faster MLX matmuls on the CPU)"
    apt_install libopenblas0 || say "could not install libopenblas0; going on without it"
fi

# --- Python environment ----------------------------------------------------------------
if [ -n "${VIRTUAL_ENV:-}" ]; then
    say "using the active virtualenv $VIRTUAL_ENV"
else
    if [ ! -x .venv/bin/python ]; then
        py="${PYTHON:-python3}"
        command -v "$py" >/dev/null 2>&1 || die "$py not found; install Python >= 3.10"
        "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
            die "$py is Python $("$py" -c 'import platform; print(platform.python_version())'); specfleet needs >= 3.10 (set PYTHON=python3.11)"
        say "creating .venv with $py"
        if ! "$py" -m venv .venv; then
            # Debian ships venv's pip bootstrap in a separate package.
            $can_apt || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
            rm -rf .venv
            say "installing python3-venv (apt-get)"
            apt_install python3-venv || die "apt-get install python3-venv failed"
            "$py" -m venv .venv
        fi
    fi
    VIRTUAL_ENV="$(pwd)/.venv"
    say "using .venv"
fi
export VIRTUAL_ENV
# On PATH first, so tests that start spec-worker or redis clients as subprocesses find ours.
export PATH="$VIRTUAL_ENV/bin:$PATH"
python="$VIRTUAL_ENV/bin/python"
"$python" -m pip --version >/dev/null 2>&1 || "$python" -m ensurepip -q

say "pip install -e .[engine,test] ($("$python" -c 'import platform; print(platform.python_version())'))"
"$python" -m pip install -q --disable-pip-version-check -e ".[engine,test]"

# --- lint --------------------------------------------------------------------------------
lint_ok=true
say "ruff check"
"$python" -m ruff check . || lint_ok=false
say "ruff format --check"
"$python" -m ruff format --check . || lint_ok=false
$lint_ok || die "lint failed; \`ruff check --fix . && ruff format .\` fixes most of it"

# --- tests -------------------------------------------------------------------------------
# SPEC_TEST_WORKERS test processes (pytest-xdist; default 2, 1 for one process): each has
# its own private redis-server, and the suite's waits on real workers overlap.
workers="${SPEC_TEST_WORKERS:-2}"
parallel=""
if [ "$workers" != 1 ]; then parallel="-n $workers"; fi
say "pytest --durations=15 $parallel ${*:-}"
rc=0
# shellcheck disable=SC2086
"$python" -m pytest -q --durations=15 $parallel ${1+"$@"} || rc=$?
case "$rc" in
0) say "all passed" ;;
5)
    printf 'error: pytest collected no tests (exit 5): that counts as a failure\n' >&2
    exit 5
    ;;
*)
    printf 'error: pytest failed (exit %s)\n' "$rc" >&2
    exit "$rc"
    ;;
esac
