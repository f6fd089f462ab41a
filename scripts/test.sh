#!/usr/bin/env bash
# The project's test command: installs the real clients the end-to-end tests
# use (as root, with apt-get, only when missing), checks formatting and lints,
# then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v fio >/dev/null || need+=(fio)
command -v nbdfuse >/dev/null || need+=(libnbd-bin fuse3)
command -v nbdinfo >/dev/null || need+=(libnbd-bin)
command -v qemu-img >/dev/null || need+=(qemu-utils)
command -v fusermount3 >/dev/null || need+=(fuse3)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v nbdkit >/dev/null || need+=(nbdkit)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test.sh: missing ${need[*]}; run as root so apt-get can install them" >&2
    exit 1
  fi
  echo "scripts/test.sh: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/test.sh: the end-to-end tests need root (loop devices, mount)" >&2
  exit 1
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# public docs: every item documented (missing_docs in the crates) and every
# intra-doc link resolving
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --workspace -- --test-threads=2
