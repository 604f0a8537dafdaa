#!/usr/bin/env bash
# Checks the packages scripts/package.sh built into target/packages/,
# without installing them (scripts/test-packages.sh installs the .debs):
#
#   scripts/check-packages.sh [DIR]        default DIR: target/packages
#
# - every .deb: `lintian --fail-on error` (overrides, each with its reason,
#   in packaging/lintian/NAME, shipped in the package);
# - every .rpm: `rpm -qpl` (its paths) and `rpm -qpR` (its dependencies)
#   against packaging/expected/NAME.files and NAME.requires, one line each,
#   `*` matching anything (the Slurm library's SONAME, the documentation's
#   files); symbol-versioned dependencies (GLIBC_2.x) are checked below
#   instead;
# - every ELF file in the RPMs asks for no glibc symbol version newer than
#   2.28 (objdump -T), the glibc of EL8; the newest libibverbs and librdmacm
#   versions they ask for are printed (EL8's rdma-core must have them);
# - librfaas has the SONAME librfaas.so.1 in both formats.
#
# Each failure names the package, what was expected and what was found.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"
dir=${1:-target/packages}
readonly MAX_GLIBC=2.28

ensure_packages "${PACKAGE_PACKAGES[@]}"
failures=0
fail() {
    echo "FAILED: $*" >&2
    failures=$((failures + 1))
}

shopt -s nullglob
# The .debs, and rfaas-slurm built for other Slurm releases (slurm-X.Y/).
debs=("$dir"/*.deb "$dir"/slurm-*/*.deb)
rpms=("$dir"/*.rpm)
[ ${#debs[@]} -gt 0 ] || fail "no .deb in $dir: run scripts/package.sh first"
[ ${#rpms[@]} -gt 0 ] || fail "no .rpm in $dir: run scripts/package.sh first"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

start=$SECONDS
echo "== lintian --fail-on error (${#debs[@]} packages)"
if [ ${#debs[@]} -gt 0 ]; then
    lintian --fail-on error --no-tag-display-limit "${debs[@]}" ||
        fail "lintian reports errors above; fix the package, or override a tag in" \
            "packaging/lintian/NAME with the reason on the line above it"
fi
echo "stage: lintian: $((SECONDS - start)) s"

# Whether every line of ACTUAL matches a pattern of EXPECTED and every
# pattern matches a line; prints what does not.
#   match_lists WHAT ACTUAL_FILE EXPECTED_FILE
match_lists() {
    local what=$1 actual=$2 expected=$3 line pat ok=0
    local -a pats=()
    local -A regex=()
    while IFS= read -r pat; do
        [[ -z $pat || $pat == \#* ]] && continue
        pats+=("$pat")
        # Only `*` is special: rpm's names are full of ( ) and dots.
        regex[$pat]="^$(printf '%s' "$pat" | sed 's/[][\.^$()|+?{}]/\\&/g; s/\*/.*/g')\$"
    done <"$expected"
    local -A used=()
    while IFS= read -r line; do
        local hit=""
        for pat in "${pats[@]}"; do
            if [[ $line =~ ${regex[$pat]} ]]; then
                hit=1
                used[$pat]=1
                break
            fi
        done
        [ -n "$hit" ] || { fail "$what: unexpected '$line' (not in $expected)"; ok=1; }
    done <"$actual"
    for pat in "${pats[@]}"; do
        [ -n "${used[$pat]:-}" ] || { fail "$what: missing '$pat' (listed in $expected)"; ok=1; }
    done
    return $ok
}

echo "== rpm -qpl, rpm -qpR against packaging/expected"
for rpm in "${rpms[@]}"; do
    name=$(rpm -qp --qf '%{NAME}' "$rpm" 2>/dev/null)
    expected=packaging/expected/$name
    if [ ! -r "$expected.files" ] || [ ! -r "$expected.requires" ]; then
        fail "$rpm: no $expected.files or $expected.requires to check it against"
        continue
    fi
    rpm -qpl "$rpm" 2>/dev/null >"$work/$name.files"
    # Versioned symbol dependencies are the ELF check's business.
    rpm -qpR "$rpm" 2>/dev/null | grep -v '(GLIBC_[0-9.]*)' | sort -u >"$work/$name.requires"
    match_lists "$name files" "$work/$name.files" "$expected.files" &&
        match_lists "$name requires" "$work/$name.requires" "$expected.requires" &&
        echo "$name: $(wc -l <"$work/$name.files") paths, dependencies as expected"
done

# The newest version of symbol set PREFIX (GLIBC_, IBVERBS_, RDMACM_) the
# ELF files below DIR ask for.
newest() { find "$2" -type f -exec objdump -T {} + 2>/dev/null | grep -o "$1[0-9.]*" | sort -uV | tail -1; }

# The newest GLIBC_ version ELF asks for, if it is newer than MAX_GLIBC
# (prints nothing and fails when it asks for none).
#   glibc_too_new ELF
glibc_too_new() {
    local v
    v=$(objdump -T "$1" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
    [ -n "$v" ] || return 1
    [ "$(printf '%s\n' "${v#GLIBC_}" "$MAX_GLIBC" | sort -V | tail -1)" = "$MAX_GLIBC" ] || echo "$v"
}
# The check can fail: this machine's own ls asks for a newer glibc on any
# Debian since 12.
[ -n "$(glibc_too_new /usr/bin/ls)" ] ||
    fail "the glibc check passes /usr/bin/ls, built for this host's glibc: the check is broken"

echo "== ELF files in the RPMs: glibc symbol versions <= $MAX_GLIBC"
for rpm in "${rpms[@]}"; do
    name=$(rpm -qp --qf '%{NAME}' "$rpm" 2>/dev/null)
    mkdir -p "$work/root/$name"
    rpm2archive - <"$rpm" | tar -xzf - -C "$work/root/$name"
    while IFS= read -r -d '' elf; do
        [ "$(head -c4 "$elf")" = $'\x7fELF' ] || continue
        rel=${elf#"$work/root/$name"}
        too_new=$(glibc_too_new "$elf") ||
            fail "$name: $rel: objdump -T lists no GLIBC_ version (not a dynamic ELF?)"
        [ -z "$too_new" ] ||
            fail "$name: $rel needs $too_new, newer than EL8's $MAX_GLIBC:" \
                "build with scripts/package.sh (cargo zigbuild for glibc $MAX_GLIBC), not cargo build"
        echo "$name: $rel: newest $(objdump -T "$elf" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
    done < <(find "$work/root/$name" -type f -print0)
done
echo "newest libibverbs symbol version asked for: $(newest IBVERBS_ "$work/root")"
echo "newest librdmacm symbol version asked for: $(newest RDMACM_ "$work/root")"

echo "== librfaas SONAME"
soname_of() { readelf -d "$1" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'; }
lib=$work/root/rfaas-client/usr/lib64/librfaas.so.1
[ "$(soname_of "$lib" 2>/dev/null)" = librfaas.so.1 ] ||
    fail "rfaas-client RPM: /usr/lib64/librfaas.so.1 has SONAME '$(soname_of "$lib" 2>/dev/null)', not librfaas.so.1"
for deb in "$dir"/rfaas-client_*.deb; do
    dpkg-deb -x "$deb" "$work/deb"
    lib=$work/deb/usr/lib/x86_64-linux-gnu/librfaas.so.1
    got=$(soname_of "$lib" 2>/dev/null || true)
    [ "$got" = librfaas.so.1 ] || fail "$deb: librfaas.so.1 has SONAME '$got', not librfaas.so.1"
    echo "$(basename "$deb"): librfaas.so.1 has SONAME $got"
done

echo "stage: package checks: $((SECONDS - start)) s"
if [ "$failures" -gt 0 ]; then
    loud "FAILED: $failures package check(s) above."
    exit 1
fi
echo "packages in $dir: all checks passed"
