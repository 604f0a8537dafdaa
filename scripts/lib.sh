# Shared helpers for rfaas scripts. Source it; do not run it.
# shellcheck shell=bash

# Installs Debian packages that are missing, updating the package lists once.
ensure_packages() {
    local missing=()
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "rfaas: installing ${missing[*]}" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -q \
        --no-install-recommends "${missing[@]}" >/dev/null
}

# What building rfaas needs (verbs: libibverbs, librdmacm; bindgen: libclang).
# shellcheck disable=SC2034 # used by the scripts that source this file
BUILD_PACKAGES=(build-essential pkg-config libibverbs-dev librdmacm-dev libclang-dev clang)

# What the tests need besides the build: bubblewrap (the executor's sandbox
# tests) and OpenMPI (the MPI example).
# shellcheck disable=SC2034
TEST_PACKAGES=(bubblewrap openmpi-bin libopenmpi-dev)

ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
    fi
    command -v cargo >/dev/null 2>&1 || {
        echo "rfaas: cargo is missing; install Rust (https://rustup.rs) and run this again" >&2
        exit 1
    }
}

# Prints a banner nobody reading a CI log can miss, on stderr.
loud() {
    local bar='!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!'
    printf '\n%s\n' "$bar" >&2
    printf '!!! %s\n' "$@" >&2
    printf '%s\n\n' "$bar" >&2
}

# The repository root.
repo_root() {
    cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd
}
