#!/bin/bash
# The wheels Unsloth 2026.10.9 needs on the device machine (torch, triton, transformers, peft and accelerate
# are there already), downloaded here into .whl/unsloth/ (git-ignored) to be carried; shared/BENCHMARKING.md
# lists the set. unsloth's own wheel is 28 MB because of an 82 MB studio/ web app: it is unpacked, studio/
# and unsloth_cli/ (top-level folders of the wheel) dropped with their RECORD lines, and re-zipped (about 2 MB), so the set with
# bitsandbytes fits one call's 64 MiB carry. bitsandbytes' wheel (61 MB: one library per CUDA and ROCm release)
# is cut the same way to its CPU and CUDA 13.0 libraries (the device's CUDA; 3.3 MB) into .whl/. Binary wheels are
# fetched for the device's Python (3.12).
#
#   bash benchmarks/unsloth_wheels.sh          # then carry .whl/ and, on the device:
#   pip install -q --no-index --no-deps --target /tmp/wheels .whl/unsloth/*.whl .whl/bitsandbytes-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl/unsloth
rm -rf "$out" && mkdir -p "$out"
pip download -q --no-deps -d "$out" --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
    unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 tyro docstring_parser shtab typeguard \
    "datasets<5" dill multiprocess cut_cross_entropy torchao msgspec hf_transfer structlog json5 nest_asyncio \
    pydantic pydantic_core annotated_types typing_inspection
rm -f .whl/bitsandbytes-*.whl
pip download -q --no-deps -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux_2_24_x86_64 \
    bitsandbytes==0.49.2
python - "$out" <<'EOF'
import pathlib, sys, zipfile


def cut(wheel, dropped):
    """Rewrite ``wheel`` without the files for which ``dropped(name)`` holds, and without their RECORD lines."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if dropped(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if not dropped(line.decode().split(",")[0]))
            dst.writestr(item, data)
    slim.replace(wheel)


out = pathlib.Path(sys.argv[1])
cut(next(out.glob("unsloth-2026*.whl")), lambda name: name.startswith(("studio/", "unsloth_cli/")))
kept = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so")
cut(next(out.parent.glob("bitsandbytes-*.whl")),
    lambda name: name.startswith("bitsandbytes/libbitsandbytes_") and not name.endswith(kept))
EOF
du -ch "$out"/*.whl .whl/bitsandbytes-*.whl | tail -1
