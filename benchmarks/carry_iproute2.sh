#!/usr/bin/env bash
# Make a folder holding `ip` and `tc` (iproute2) with the libraries they load, to carry to a
# machine that lacks them (the GPU machines of docs/gpu.md) so the emulated links run there.
#
#   benchmarks/carry_iproute2.sh [DIR]          # default .ipr; needs apt-get (Debian or Ubuntu)
#   PATH=$PWD/.ipr/bin:$PATH gradsync bench --net 1gbit ...     # on the other machine
#
# DIR/bin/ip and DIR/bin/tc start the real programs through the dynamic loader with DIR/lib as
# their library path, so nothing is installed and the processes they start (`ip netns exec
# ... python`) do not inherit that path. Add DIR to .git/info/exclude; it is about 7 MB.
set -eu
dir=${1:-.ipr}
command -v apt-get >/dev/null && command -v dpkg >/dev/null ||
    { echo "carry_iproute2.sh: needs apt-get and dpkg (Debian or Ubuntu) to fetch iproute2's packages" >&2; exit 2; }
debs=$(mktemp -d)
trap 'rm -rf "$debs"' EXIT
(cd "$debs" && apt-get download iproute2 libbpf1 libbsd0 libmd0 libcap2 libdb5.3 libelf1 libmnl0 \
    libselinux1 libpcre2-8-0 libtirpc3 libxtables12 libzstd1 zlib1g libgssapi-krb5-2 libkrb5-3 \
    libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 >/dev/null)
rm -rf "$dir"
mkdir -p "$dir/root" "$dir/bin" "$dir/lib"
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$dir/root"; done
for libdir in "$dir"/root/lib/x86_64-linux-gnu "$dir"/root/usr/lib/x86_64-linux-gnu; do
    [ -d "$libdir" ] && cp -a "$libdir"/. "$dir/lib/"
done
for tool in ip tc; do
    cp "$(find "$dir/root" -path "*bin/$tool" -type f | head -1)" "$dir/bin/$tool.real"
    printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nexec /lib64/ld-linux-x86-64.so.2 --library-path "$d/../lib" "$d/%s.real" "$@"\n' \
        "$tool" > "$dir/bin/$tool"
    chmod +x "$dir/bin/$tool"
done
rm -rf "$dir/root"
"$dir/bin/ip" -V && "$dir/bin/tc" -V
