#!/usr/bin/env bash
# Install valkey-server (8.0 from Debian bookworm-backports) when it is missing, for scripts/test.sh's
# Valkey pass. Backports come through a private source list and private package lists (the same way
# tests/windows/setup.sh gets Mesa), so /etc/apt and the machine's own lists stay as they are; the
# private list names bookworm main too, for whatever valkey-server depends on that is not installed.
# Needs root (it is CI's, through .ci/run). Prints the installed valkey-server's version.
set -euo pipefail
ROOT=${ORTQ_VALKEY_APT_ROOT:-/var/cache/ortq-valkey}

die() { echo "scripts/valkey.sh: $*" >&2; exit 1; }

if ! command -v valkey-server >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "valkey-server is missing and installing it needs root"
    mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$mirror" ] || mirror=$(awk '$1=="deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [ -n "$mirror" ] || die "cannot find this machine's Debian mirror for bookworm-backports"
    mkdir -p "$ROOT/lists/partial"
    {
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bookworm main"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bookworm-backports main"
    } >"$ROOT/sources.list"
    apt_bpo=(-o Dir::State::Lists="$ROOT/lists" -o Dir::Etc::SourceList="$ROOT/sources.list"
             -o Dir::Etc::SourceParts=/nonexistent)
    export DEBIAN_FRONTEND=noninteractive
    echo "scripts/valkey.sh: valkey-server from bookworm-backports ($mirror)" >&2
    timeout 600 apt-get "${apt_bpo[@]}" update -qq >/dev/null
    # --no-install-recommends: valkey-server's package would otherwise pull in nothing the tests need.
    timeout 900 apt-get "${apt_bpo[@]}" install -y -qq --no-install-recommends -t bookworm-backports valkey-server >/dev/null
    command -v valkey-server >/dev/null 2>&1 || die "valkey-server is still missing after the install"
    # The package starts a system service on 6379 where systemd runs; the tests start their own.
fi
valkey-server --version
