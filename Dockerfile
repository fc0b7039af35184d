# NSCLC-Radiomics SwinUNETR bundle. ROCm (AMD Instinct) by default; for NVIDIA:
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime -t nsclc-swinunetr:cuda .
#   docker build -t nsclc-swinunetr:rocm .
# Run on one AMD GPU (pick it by its render node; see README "Docker"), or use docker-compose.yml:
#   docker run --rm -it --device=/dev/kfd --device=/dev/dri/renderD128 --group-add video \
#     --ipc=host -v /data/tcia:/data/tcia -v $PWD/runs:/workspace/bundle/runs nsclc-swinunetr:rocm
ARG BASE_IMAGE=rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.6.0
FROM ${BASE_IMAGE}

# MIOpen/TunableOp settings are NOT baked in here: scripts/accelerator.py sets them from the config
# (miopen_find_mode 1, miopen_find_enforce 3, a persistent MIOpen DB under <output_dir>/miopen -- mount runs/ as a
# volume and tuning is paid once). A value exported with `docker run -e MIOPEN_...` still wins, and
# <output_dir>/device_report.json records which values were in force.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

WORKDIR /workspace/bundle
# requirements first: the layer is rebuilt only when they change; torch comes from the base image
COPY requirements.txt .
RUN python -m pip install --no-cache-dir -r requirements.txt
COPY . .

# the demo trains on synthetic DICOM in minutes and proves the image works end to end
CMD ["python", "-m", "monai.bundle", "run", "--config_file", "['configs/train.yaml','configs/demo.yaml']"]
