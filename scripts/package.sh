#!/usr/bin/env bash
# Builds rfaas's Debian packages and RPMs into target/packages/
# (docs/packages.md says what each holds):
#
#   scripts/package.sh [deb|rpm|all] [--only NAME]... [--deb-version V] [--example-job]
#
#   NAME          rfaas-executor, rfaas-manager, rfaas-accounting,
#                 rfaas-client or rfaas-slurm (default: all five)
#   --deb-version the .debs' version instead of Cargo's (the upgrade test
#                 builds an older one: 0.1.0~prev-1)
#   --example-job also builds the example job of docs/install.md's last
#                 step into target/packages/example-job/: offload_matmul and
#                 the function library it ships (from the same release build,
#                 so it adds two small targets, not a second build)
#
#   SLURM_INCLUDE_DIR  the Slurm headers rfaas-slurm is built against
#                      (default /usr/include); the package depends on the
#                      libslurm of the same Slurm, read off the system (or
#                      root) those headers belong to. Another Slurm's headers
#                      (e.g. a Debian 13 root's) build rfaas-slurm alone
#                      (--only rfaas-slurm), in target/package-slurm-X.Y,
#                      into target/packages/slurm-X.Y/
#
# One release build serves both formats: cargo-zigbuild links for glibc
# 2.28 (EL8; Debian 12 and 13 run those binaries too), with the verbs
# provider, in its own target directory (target/package), so the debug
# build of the tests stays fresh. Its tools are installed once per machine
# into /var/cache/rfaas/tools (RFAAS_TOOLS_DIR), one directory per tool
# and version: ziglang and cargo-zigbuild from PyPI in a virtualenv,
# cargo-deb and cargo-generate-rpm with `cargo install --locked`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

readonly ZIG_VERSION=0.14.1 ZIGBUILD_VERSION=0.24.1
readonly CARGO_DEB_VERSION=3.8.0 GENERATE_RPM_VERSION=0.21.1
readonly TRIPLE=x86_64-unknown-linux-gnu GLIBC=2.28 MULTIARCH=x86_64-linux-gnu
readonly ALL_PACKAGES=(rfaas-executor rfaas-manager rfaas-accounting rfaas-client rfaas-slurm)
# The crate directory of each package.
declare -A CRATE_DIR=([rfaas-executor]=executor [rfaas-manager]=manager
    [rfaas-accounting]=accounting [rfaas-client]=client/capi [rfaas-slurm]=slurm-spank)
# The Cargo.toml metadata names this directory (../target/package/stage).
export CARGO_TARGET_DIR=$root/target/package
readonly TOOLS=${RFAAS_TOOLS_DIR:-/var/cache/rfaas/tools}
OUT=$root/target/packages
readonly STAGE=$CARGO_TARGET_DIR/stage

usage() {
    echo "usage: scripts/package.sh [deb|rpm|all] [--only NAME]... [--deb-version V] [--example-job]" >&2
    echo "  NAME: ${ALL_PACKAGES[*]}" >&2
    exit 2
}

formats=(deb rpm)
packages=()
deb_version=""
example_job=0
while [ $# -gt 0 ]; do
    case "$1" in
    deb | rpm) formats=("$1") ;;
    all) formats=(deb rpm) ;;
    --only)
        [ $# -ge 2 ] && [ -n "${CRATE_DIR[$2]:-}" ] || {
            echo "package.sh: --only takes one of: ${ALL_PACKAGES[*]} (got '${2:-}')" >&2
            usage
        }
        packages+=("$2")
        shift
        ;;
    --example-job) example_job=1 ;;
    --deb-version)
        [ $# -ge 2 ] || usage
        deb_version=$2
        shift
        ;;
    *) usage ;;
    esac
    shift
done
[ ${#packages[@]} -gt 0 ] || packages=("${ALL_PACKAGES[@]}")

# The Slurm rfaas-slurm is built against: the system's, or another root's.
slurm_include=${SLURM_INCLUDE_DIR:-/usr/include}
slurm_root=${slurm_include%/usr/include}
other_slurm=""
if [ "$slurm_include" != /usr/include ]; then
    [ "${packages[*]}" = rfaas-slurm ] && [ "$example_job" = 0 ] || {
        echo "package.sh: SLURM_INCLUDE_DIR=$slurm_include builds rfaas-slurm for that Slurm" \
            "alone: add --only rfaas-slurm (the other packages do not depend on Slurm)" >&2
        exit 2
    }
    num=$(sed -n 's/^#define SLURM_VERSION_NUMBER *//p' "$slurm_include/slurm/slurm_version.h" 2>/dev/null) || true
    [ -n "$num" ] || {
        echo "package.sh: rfaas-slurm: $slurm_include/slurm/slurm_version.h not found or without" \
            "SLURM_VERSION_NUMBER: point SLURM_INCLUDE_DIR at Slurm's headers" >&2
        exit 1
    }
    other_slurm=$(printf '%d.%02d' $(((num >> 16) & 255)) $(((num >> 8) & 255)))
    # Its own target directory: the plugin built for the system's Slurm
    # in target/package stays as it is.
    export CARGO_TARGET_DIR=$root/target/package-slurm-$other_slurm
    OUT=$root/target/packages/slurm-$other_slurm
fi
readonly OUT

# Fills $TOOLS/NAME with `INSTALL_FN DIR ARG` unless an earlier run
# finished it (DIR/.done), under lib.sh's build_once, so concurrent runs
# install once.
#   ensure_tool NAME INSTALL_FN [ARG]
ensure_tool() {
    local dir=$TOOLS/$1
    [ -e "$dir/.done" ] && return 0
    mkdir -p "$TOOLS"
    build_once "$TOOLS/.lock" 0 "test -e $dir/.done" "install_tool $dir $2 ${3:-}"
}
install_tool() {
    echo "rfaas: installing $(basename "$1") into $TOOLS (once per machine)" >&2
    rm -rf "$1"
    "$2" "$1" "${3:-}" && touch "$1/.done"
}
install_cargo_tool() { CARGO_INSTALL_ROOT=$1 cargo install --locked --quiet "$2"; }
install_zigbuild() {
    python3 -m venv "$1"
    "$1/bin/pip" install --quiet --disable-pip-version-check \
        "ziglang==$ZIG_VERSION" "cargo-zigbuild==$ZIGBUILD_VERSION"
}

ensure_packages "${BUILD_PACKAGES[@]}" "${SLURM_PACKAGES[@]}" "${PACKAGE_PACKAGES[@]}" python3 python3-venv
ensure_rust
zig_dir=zigbuild-$ZIGBUILD_VERSION-zig-$ZIG_VERSION
ensure_tool "$zig_dir" install_zigbuild
if [[ " ${formats[*]} " == *" deb "* ]]; then
    ensure_tool "cargo-deb-$CARGO_DEB_VERSION" install_cargo_tool "cargo-deb@$CARGO_DEB_VERSION"
fi
if [[ " ${formats[*]} " == *" rpm "* ]]; then
    ensure_tool "cargo-generate-rpm-$GENERATE_RPM_VERSION" install_cargo_tool \
        "cargo-generate-rpm@$GENERATE_RPM_VERSION"
fi
# The venv's python3 runs zig (python3 -m ziglang) for cargo-zigbuild.
export PATH=$TOOLS/$zig_dir/bin:$TOOLS/cargo-deb-$CARGO_DEB_VERSION/bin:$TOOLS/cargo-generate-rpm-$GENERATE_RPM_VERSION/bin:$PATH

# All five crates in one build whatever --only says: a narrower one would
# resolve other features and build the dependencies again.
start=$SECONDS
echo "== release build for glibc $GLIBC (cargo zigbuild, target/package)"
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols
zigbuild() { cargo zigbuild --release --target "$TRIPLE.$GLIBC" "$@"; }
if [ -n "$other_slurm" ]; then
    zigbuild -p rfaas-slurm-spank
else
    zigbuild --features rfaas-fabric/verbs -p rfaas-executor -p rfaas-manager -p rfaas-accounting \
        -p rfaas-capi -p rfaas-slurm-spank
fi
if [ "$example_job" = 1 ]; then
    # Same target directory, profile and features: only the two targets build.
    zigbuild --features rfaas-fabric/verbs -p rfaas-client --example offload_matmul
    zigbuild -p rfaas-example-functions --lib
    mkdir -p "$OUT/example-job"
    cp "$CARGO_TARGET_DIR/$TRIPLE/release/examples/offload_matmul" \
        "$CARGO_TARGET_DIR/$TRIPLE/release/librfaas_example_functions.so" "$OUT/example-job/"
    echo "example job: $OUT/example-job/{offload_matmul,librfaas_example_functions.so}"
fi
echo "stage: package release build: $((SECONDS - start)) s"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

# What the packages hold besides the build: rfaas.pc and the plugstack.conf
# snippet per format (library and plugin directories differ), and the
# client crate's documentation.
#   stage_files FORMAT LIBDIR PLUGIN_DIR
stage_files() {
    mkdir -p "$STAGE/$1"
    sed -e "s|@PREFIX@|/usr|" -e "s|@VERSION@|$version|" -e "s|^libdir=.*|libdir=$2|" \
        -e "s|^Libs.private: |&-libverbs -lrdmacm |" client/capi/rfaas.pc.in >"$STAGE/$1/rfaas.pc"
    sed -e "s|@PLUGIN_DIR@|$3|" packaging/slurm/plugstack-rfaas.conf >"$STAGE/$1/plugstack-rfaas.conf"
}
stage_files deb "/usr/lib/$MULTIARCH" "/usr/lib/$MULTIARCH/slurm-wlm"
stage_files rpm /usr/lib64 /usr/lib64/slurm
if [[ " ${packages[*]} " == *" rfaas-client "* ]]; then
    start=$SECONDS
    cargo doc --quiet -p rfaas-client --no-deps
    rm -rf "$STAGE/doc"
    cp -r "$CARGO_TARGET_DIR/doc" "$STAGE/doc"
    rm -f "$STAGE/doc/.lock"
    echo "stage: rfaas-client documentation: $((SECONDS - start)) s"
fi

# The Slurm rfaas-slurm is built against: its version (slurm_version.h)
# and libslurm's SONAME, from the system or root SLURM_INCLUDE_DIR is in.
slurm_soname() {
    local h=$slurm_include/slurm/slurm_version.h lib
    [ -r "$h" ] || {
        echo "package.sh: rfaas-slurm: $h not found: install libslurm-dev (Debian) or" \
            "slurm-devel (RHEL family), or set SLURM_INCLUDE_DIR to the Slurm headers" >&2
        exit 1
    }
    lib=$(ls "$slurm_root"/usr/lib/"$MULTIARCH"/libslurm.so.[0-9]* "$slurm_root"/usr/lib64/libslurm.so.[0-9]* \
        2>/dev/null | head -1)
    [ -n "$lib" ] || {
        echo "package.sh: rfaas-slurm: no libslurm.so.N next to $h (in $slurm_root/usr/lib):" \
            "install Slurm's library package (libslurmNN on Debian)" >&2
        exit 1
    }
    objdump -p "$lib" | sed -n 's/^ *SONAME *//p'
}
# Prints "MAJOR.MINOR NEXT" of that Slurm: 22.05 22.06 (Debian's versions).
slurm_version() {
    local num
    num=$(sed -n 's/^#define SLURM_VERSION_NUMBER *//p' "$slurm_include/slurm/slurm_version.h")
    printf '%d.%02d %d.%02d\n' $(((num >> 16) & 255)) $(((num >> 8) & 255)) \
        $(((num >> 16) & 255)) $((((num >> 8) & 255) + 1))
}

build_deb() {
    local name=$1 deb args=()
    [ -z "$deb_version" ] || args=(--deb-version "$deb_version")
    rm -f "$OUT/${name}_"*.deb
    deb=$(cargo deb --no-build --quiet --target "$TRIPLE" -p "$(crate_name "$name")" \
        --maintainer "$MAINTAINER" -o "$OUT" "${args[@]}")
    case "$name" in
    rfaas-client)
        # librfaas.so.1's users depend on this package (lintian: no-shlibs).
        deb_rewrite "$deb" '' DEBIAN/shlibs "librfaas 1 rfaas-client (>= $version)"
        ;;
    rfaas-slurm)
        local lib pkg v next
        lib=$(slurm_soname)
        pkg=$(dpkg-query --admindir="$slurm_root/var/lib/dpkg" -S "/usr/lib/$MULTIARCH/$lib" | cut -d: -f1)
        read -r v next < <(slurm_version)
        echo "rfaas-slurm: built for Slurm $v ($lib, Debian package $pkg)" >&2
        # The plugin loads only under the major.minor it was built for.
        deb_rewrite "$deb" "s/^Depends: .*/&, $pkg, slurm-wlm-basic-plugins (>= $v), slurm-wlm-basic-plugins (<< $next~)/"
        ;;
    esac
    echo "$deb"
}

build_rpm() {
    local name=$1 args=()
    rm -f "$OUT/$name-"[0-9]*.rpm
    if [ "$name" = rfaas-slurm ]; then
        local lib
        lib=$(slurm_soname)
        echo "rfaas-slurm: built for Slurm $(slurm_version | cut -d' ' -f1) (requires $lib()(64bit))" >&2
        args=(-s "requires = { \"$lib()(64bit)\" = \"*\" }")
    fi
    cargo generate-rpm --auto-req builtin --target "$TRIPLE" -p "${CRATE_DIR[$name]}" -o "$OUT/" "${args[@]}"
    ls "$OUT/$name-"*.rpm
}

crate_name() { sed -n 's/^name = "\(.*\)"/\1/p' "${CRATE_DIR[$1]}/Cargo.toml" | head -1; }

readonly MAINTAINER="rfaas maintainers <rfaas-maintainers@lists.example.org>"
mkdir -p "$OUT"
start=$SECONDS
for format in "${formats[@]}"; do
    for name in "${packages[@]}"; do
        "build_$format" "$name"
    done
done
echo "stage: packaging (${formats[*]}): $((SECONDS - start)) s"
ls -l "$OUT"
