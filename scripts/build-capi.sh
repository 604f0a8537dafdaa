#!/usr/bin/env bash
# Builds librfaas, the C API of the rfaas client, and installs it:
#
#   scripts/build-capi.sh [--debug] [PREFIX]    default PREFIX: target/capi-prefix
#
#   PREFIX/lib/librfaas.so.1 (its SONAME) and the link librfaas.so to it,
#   PREFIX/lib/librfaas.a, PREFIX/include/rfaas.h, PREFIX/lib/pkgconfig/rfaas.pc
#
# By default: a release build with the tcp and shm providers. --debug
# installs instead the debug build that CI makes once for all its stages
# (scripts/test.sh's first step, CI_BUILD in lib.sh): the whole workspace
# with the verbs provider, so that librfaas also links libibverbs and
# librdmacm, and rfaas.pc says so.
#
# Building regenerates client/capi/include/rfaas.h (cbindgen); in a git
# checkout the script fails when that changed the committed header, so a
# stale header never lands.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

profile=release
if [ "${1:-}" = --debug ]; then
    profile=debug
    shift
fi
prefix=${1:-target/capi-prefix}
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
target=${CARGO_TARGET_DIR:-$root/target}

ensure_rust
libs_private=""
if [ "$profile" = debug ]; then
    echo "== cargo build ${CI_BUILD[*]}"
    cargo build "${CI_BUILD[@]}"
    libs_private="-libverbs -lrdmacm "
else
    echo "== cargo build --release -p rfaas-capi"
    cargo build --release -p rfaas-capi
fi

header=client/capi/include/rfaas.h
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 &&
    git ls-files --error-unmatch "$header" >/dev/null 2>&1; then
    if ! git diff --exit-code --stat -- "$header"; then
        git --no-pager diff -- "$header" | head -80 >&2
        loud "FAILED: $header is stale: building client/capi regenerated it differently." \
            "Commit the regenerated header (cargo build -p rfaas-capi writes it)."
        exit 1
    fi
fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$target/$profile/librfaas.so" "$prefix/lib/librfaas.so.1"
ln -sfn librfaas.so.1 "$prefix/lib/librfaas.so"
install -m 0644 "$target/$profile/librfaas.a" "$prefix/lib/librfaas.a"
install -m 0644 "$header" "$prefix/include/rfaas.h"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" \
    -e "s|^Libs.private: |&$libs_private|" client/capi/rfaas.pc.in \
    >"$prefix/lib/pkgconfig/rfaas.pc"
echo "installed librfaas $version ($profile) into $prefix"
echo "  use: PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs rfaas"
