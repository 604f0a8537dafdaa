#!/usr/bin/env bash
# Builds librfaas, the C API of the rfaas client, and installs it:
#
#   scripts/build-capi.sh [PREFIX]       default PREFIX: target/capi-prefix
#
#   PREFIX/lib/librfaas.so, PREFIX/lib/librfaas.a, PREFIX/include/rfaas.h,
#   PREFIX/lib/pkgconfig/rfaas.pc
#
# Building regenerates client/capi/include/rfaas.h (cbindgen); in a git
# checkout the script fails when that changed the committed header, so a
# stale header never lands.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

prefix=${1:-target/capi-prefix}
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
target=${CARGO_TARGET_DIR:-$root/target}

ensure_rust
echo "== cargo build --release -p rfaas-capi"
cargo build --release -p rfaas-capi

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
install -m 0755 "$target/release/librfaas.so" "$prefix/lib/librfaas.so"
install -m 0644 "$target/release/librfaas.a" "$prefix/lib/librfaas.a"
install -m 0644 "$header" "$prefix/include/rfaas.h"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" client/capi/rfaas.pc.in \
    >"$prefix/lib/pkgconfig/rfaas.pc"
echo "installed librfaas $version into $prefix"
echo "  use: PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs rfaas"
