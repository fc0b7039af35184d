# NSCLC-Radiomics SwinUNETR bundle, with torch 2.13.0: the PyTorch the bundle's tests run with (docs/requirements.md).
# NEVER BUILT: the project's machines have no container runtime, so neither this build nor a run of its image has been
# tried (docs/training.md, "Docker"). torch comes from PyTorch's own index, in the build for your GPU (TORCH_INDEX); its
# wheels carry their CUDA or ROCm libraries, so the base image needs only Python 3.11+ (the GPU driver is the host's).
# Whether PyTorch's index holds torch 2.13.0 for the CUDA or ROCm version you pick was not checked either
# (https://download.pytorch.org/whl/torch/ lists them):
#   docker build -t nsclc-swinunetr:cuda .                                                       # NVIDIA, CUDA 13.0
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/rocm6.4 -t nsclc-swinunetr:rocm .   # AMD
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t nsclc-swinunetr:cpu .        # CPU
# Run on one NVIDIA GPU, or on one AMD GPU (pick it by its render node; see docs/training.md "Docker"), or use
# docker-compose.yml:
#   docker run --rm -it --gpus '"device=0"' --ipc=host -v /data/tcia:/data/tcia \
#     -v $PWD/runs:/workspace/bundle/runs nsclc-swinunetr:cuda
#   docker run --rm -it --device=/dev/kfd --device=/dev/dri/renderD128 --group-add video \
#     --ipc=host -v /data/tcia:/data/tcia -v $PWD/runs:/workspace/bundle/runs nsclc-swinunetr:rocm
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

# MIOpen/TunableOp settings are NOT baked in here: scripts/training/accelerator.py sets them from the config
# (miopen_find_mode 1, miopen_find_enforce 3, a persistent MIOpen DB under <output_dir>/miopen -- mount runs/ as a
# volume and tuning is paid once). A value exported with `docker run -e MIOPEN_...` still wins, and
# <output_dir>/device_report.json records which values were in force.
ENV PYTHONUNBUFFERED=1

WORKDIR /workspace/bundle
# torch first, from the index of the build asked for, so that requirements' torch>=2.4 is already satisfied; then the
# requirements (this layer is rebuilt only when they change)
RUN python -m pip install --no-cache-dir torch==${TORCH_VERSION} --index-url ${TORCH_INDEX}
COPY requirements.txt .
RUN python -m pip install --no-cache-dir -r requirements.txt
COPY . .

# the DICOM node's port (docs/inference.md, "As a DICOM node"), with the node's queue on a volume:
#   docker run --rm -p 11112:11112 -v /srv/nsclc-node:/node nsclc-swinunetr:cpu python -m monai.bundle run serve \
#     --config_file configs/inference.yaml --output_dir /node --dicom_destinations "['TPS@tps.example.org:104']"
EXPOSE 11112
# the demo trains on synthetic DICOM in minutes and proves the image works end to end
CMD ["python", "-m", "monai.bundle", "run", "--config_file", "['configs/train.yaml','configs/demo.yaml']"]
