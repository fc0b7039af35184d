#!/usr/bin/env bash
# The wheels the bundle needs on a GPU machine without internet whose Python (3.12, x86-64) has torch with CUDA but
# not the bundle's other packages, downloaded here (where PyPI answers) into <project>/.whl (git-ignored).
# Usage, from anywhere in the checkout:  bash benchmarks/gpu_wheels.sh
# Then, on the GPU machine, in the copied checkout (the kit: README "Speed"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && python3 -m benchmarks.gpu_proof --output_dir /tmp/gpu_proof
# The image already holds torch (CUDA), numpy, scipy, pillow, matplotlib, tensorboard, einops, pyyaml, tqdm,
# nvidia-ml-py, lazy-loader, onnx, onnxruntime, onnxscript, pytest and requests: those are not downloaded.
# This is ../shared/device/wheels.sh (read-only there) with two fixes: pylibjpeg-libjpeg 2.5.0 ships only
# manylinux_2_31/2_34 wheels, and dicomweb-client (imported when inference.yaml starts) needs `retrying`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
# every requirement but what the image has, plus the few dependencies of theirs it lacks (highdicom -> pyjpegls,
# fire -> termcolor, nibabel -> importlib_resources, dicomweb-client -> retrying); --no-deps keeps torch out.
# OpenVINO stays out too: on a GPU `inference_backend: auto` runs the network in PyTorch (OpenVINO is only imported
# when a CPU run picks it), and its 59 MB wheel alone would pass the 64 MiB a GPU machine's copy of the checkout may hold
image='^(torch|numpy|scipy|pillow|matplotlib|tensorboard|einops|pyyaml|tqdm|nvidia-ml-py|lazy-loader|onnx|onnxruntime|onnxscript|openvino|pytest|requests)\b'
{ grep -vE '^\s*(#|-r|$)' requirements.txt | sed 's/\s*#.*//' | grep -viE "$image"
  printf '%s\n' pyjpegls termcolor importlib_resources retrying; } > .whl/reqs.txt
platforms=()
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  "${platforms[@]}" --platform any -d .whl -r .whl/reqs.txt
rm -f .whl/reqs.txt
ls .whl
du -sh .whl
