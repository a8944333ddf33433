#!/usr/bin/env bash
# System packages the test suite uses beyond Python: redis-server (real server for snapshot and
# L3 tests), nats-server (JetStream tests), chromium (headless dashboard test) and the libraries
# the Mooncake Store binaries link (libibverbs1, librdmacm1, libnuma1: the mooncake L3 tests). Installs them when it
# can (root + apt-get), otherwise says exactly what is missing; tests that need a missing one fail with that reason.
# With --build: only what compiling the C accelerators needs beyond gcc and the Python headers
# (libssl-dev: OpenSSL's headers for the producer's C helper); the Makefile runs this before the
# editable install. A C helper that still cannot build is left out and its pure path serves.
set -u
missing=()
if [ "${1:-}" = "--build" ]; then
  [ -f /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
else
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  { command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ]; } || missing+=(nats-server)
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
  for lib in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
    ldconfig -p 2>/dev/null | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
  done
  # nats-server (JetStream event-plane tests); Debian puts it in /usr/sbin.
  command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; then
    exit 0
  fi
  echo "WARNING: apt-get could not install: ${missing[*]}"
else
  echo "WARNING: missing system packages: ${missing[*]} (install with: sudo apt-get install ${missing[*]})"
fi
echo "         tests that need them will fail and say so."
exit 0
