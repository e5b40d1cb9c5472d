#!/bin/bash
# Pack a Triton wheel other than the lent machines' own (3.6) so that it fits the device tool's carry limit (64 MiB
# with the tree, ~28 MiB of which is the tree): docs/performance.md's runs 89 and 90 ran Triton 3.9 this way.
#
#   bash tools/pack_triton.sh 3.9.0 DIR
#
# writes DIR/triton.tar.xz (the package without the AMD backend's libraries, CUPTI, proton, headers other than
# cuda.h, the test plugins and the bundled binaries; libtriton.so stripped: ~37 MiB) and DIR/ptxas.xz (the wheel's
# own sm_90+ ptxas, ~12 MiB: Triton 3.9 keeps the evict-first hint on cp.async only at the PTX ISA that ptxas
# reads, 9.4). With the tree they exceed one call's carry: split the tarball (run 90: the first 34,000,000 bytes,
# `head -c`, and the rest, `tail -c +34000001`), carry the first part in one call that copies it to /tmp (which
# stays while the machine is warm, 30 s idle), and the second part and ptxas.xz in the next, issued as soon as the
# first returns, e.g. with the parts in two ignored folders, A and B:
#
#   call 1, carry ["A"]:  cp A/part.a /tmp/
#   call 2, carry ["B"]:  cat /tmp/part.a B/part.b > /tmp/t.tar.xz && mkdir -p /tmp/tnew &&
#                         python -c "import tarfile; tarfile.open('/tmp/t.tar.xz').extractall('/tmp/tnew')"
#     python -c "import lzma,shutil; shutil.copyfileobj(lzma.open('B/ptxas.xz'), open('/tmp/ptxas','wb'))"
#     chmod +x /tmp/ptxas; export TRITON_PTXAS_BLACKWELL_PATH=/tmp/ptxas PYTHONPATH=/tmp/tnew:$PWD/src:$PWD/tools
#
# (The cp312 wheel is for the lent machines' Python 3.12; xz -9e of libtriton takes ~3 minutes on two cores.)
set -euo pipefail
version=${1:?Triton version}
out=$(realpath -m "${2:?output folder}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$work/wheel" "triton==$version"
wheel=$(ls "$work"/wheel/triton-*.whl)
mkdir -p "$work/pkg" "$out"
(cd "$work/pkg" && unzip -q "$wheel" 'triton/*' 'triton-*.dist-info/*' -x 'triton/backends/amd/lib/*' 'triton/backends/amd/include/*' \
    'triton/backends/nvidia/lib/cupti*' 'triton/backends/nvidia/bin/*' 'triton/_C/libproton.so' \
    'triton/instrumentation/*' 'triton/profiler/*' 'triton/plugins/*' 'triton/FileCheck' 'triton/include/*')
find "$work/pkg/triton/backends/nvidia/include" -mindepth 1 ! -name cuda.h -exec rm -rf {} +
strip --strip-unneeded "$work/pkg/triton/_C/libtriton.so"
# (the dist-info too: Triton finds its backends through its entry points)
(cd "$work/pkg" && tar -cf - triton triton-*.dist-info | xz -9e > "$out/triton.tar.xz")
unzip -q -p "$wheel" triton/backends/nvidia/bin/ptxas-blackwell | xz -9 -T2 > "$out/ptxas.xz"
ls -la "$out"
