# NSCLC-Radiomics SwinUNETR bundle. ROCm (AMD Instinct) by default; for NVIDIA:
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime -t nsclc-swinunetr:cuda .
#   docker build -t nsclc-swinunetr:rocm .
# Run on one AMD GPU (pick it by its render node; see README "Which GPU"):
#   docker run --rm -it --device=/dev/kfd --device=/dev/dri/renderD128 --group-add video \
#     --ipc=host -v /data/tcia:/data/tcia nsclc-swinunetr:rocm
ARG BASE_IMAGE=rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.6.0
FROM ${BASE_IMAGE}

# MIOpen: search for the fastest kernels once (FIND_MODE 1 = normal find, ENFORCE 3 = search and update the DB)
# and keep its user DB in a volume-friendly place so tuning is paid once, not every container start.
ENV MIOPEN_FIND_MODE=1 \
    MIOPEN_FIND_ENFORCE=3 \
    MIOPEN_USER_DB_PATH=/workspace/bundle/runs/miopen \
    MIOPEN_CUSTOM_CACHE_DIR=/workspace/bundle/runs/miopen \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

WORKDIR /workspace/bundle
# requirements first: the layer is rebuilt only when they change; torch comes from the base image
COPY requirements.txt .
RUN python -m pip install --no-cache-dir -r requirements.txt
COPY . .

# the demo trains on synthetic DICOM in minutes and proves the image works end to end
CMD ["python", "-m", "monai.bundle", "run", "--config_file", "['configs/train.yaml','configs/demo.yaml']"]
