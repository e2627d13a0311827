#!/usr/bin/env bash
# Fuzzes each target for SECONDS (default 60) with cargo-fuzz (libFuzzer,
# AddressSanitizer) on a nightly toolchain (HEARTH_FUZZ_TOOLCHAIN; it and
# cargo-fuzz are installed if missing); exits non-zero on the first
# crash, panic, leak or input slower than 10 s, whose input is left in
# fuzz/artifacts/TARGET/. The corpus in fuzz/corpus/TARGET/ is read, not
# written: new inputs go to a scratch directory.
#
# Usage: fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")"

seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(manifest_file apply_body)
fi
toolchain=${HEARTH_FUZZ_TOOLCHAIN:-nightly}
CARGO_FUZZ_VERSION=0.13.2

log() { printf 'fuzz: %s\n' "$*" >&2; }

if ! rustup run "$toolchain" rustc --version >/dev/null 2>&1; then
    log "installing the $toolchain toolchain (cargo-fuzz needs -Z flags)"
    rustup toolchain install "$toolchain" --profile minimal
fi
if [ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
    log "installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for target in "${targets[@]}"; do
    log "$target: ${seconds}s"
    mkdir -p "$scratch/$target"
    cargo "+$toolchain" fuzz run "$target" "$scratch/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -max_len=65536 -rss_limit_mb=2048 \
        -print_final_stats=1
done
