"""The host time a training step's batch costs: train.yaml's network on PyTorch's ``meta`` device, where every
operation is dispatched as on a GPU but computes nothing.

    python -m benchmarks.bench_host                      # SwinUNETR f48, 4 patches of 96^3 (the GPU kit's rows)
    python -m benchmarks.bench_host --feature_size 12 --patches 2 --roi 64

A GPU step is only as fast as the host can issue it: when the host takes longer to issue a kernel than the GPU takes to
run it, the GPU waits between kernels. This times forward, loss and backward with the batch as MONAI's
``default_prepare_batch`` hands it (a MetaTensor: every operation goes through its ``__torch_function__``, and
indexing it decollates its metadata) and as ``plain_tensor_batch`` hands it (train.yaml's), and counts the values
read to the host (``.item()``) in each. The meta device computes each operation's output shape in Python
(PyTorch's reference implementations), which a GPU's C++ kernels do not: that part is the same in both rows and far
larger than on a GPU, so only the **difference** between the rows is the host time the batch itself costs a step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from monai.data import MetaTensor
from monai.data.utils import collate_meta_tensor
from monai.losses import DiceCELoss
from monai.networks.nets import SwinUNETR


def nifti_metadata(roi: int) -> dict:
    """The metadata MONAI's ``LoadImage`` gives a CT read from NIfTI (the prepared cases' format): its header fields."""
    import tempfile

    import nibabel as nib
    import numpy as np
    from monai.transforms import LoadImage

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/LUNG1-001_image.nii.gz"
        nib.save(nib.Nifti1Image(np.zeros((roi, roi, roi), np.int16), np.diag([0.98, 0.98, 3.0, 1.0])), path)
        return dict(LoadImage(image_only=True)(path).meta)


def batch(patches: int, roi: int, meta: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the trainer's ``prepare_batch`` gives it: with the patches' collated ``meta``, or plain (None)."""
    shape = (1, roi, roi, roi)
    if meta is None:
        return torch.empty(patches, *shape, device="meta"), torch.empty(patches, *shape, device="meta")
    images = [MetaTensor(torch.empty(shape, device="meta"), meta=dict(meta)) for _ in range(patches)]
    labels = [MetaTensor(torch.empty(shape, device="meta"), meta=dict(meta)) for _ in range(patches)]
    return collate_meta_tensor(images), collate_meta_tensor(labels)


def host_ms(network: torch.nn.Module, loss_fn, patches: int, roi: int, meta: dict | None, steps: int) -> tuple:
    """Median host milliseconds of forward + loss + backward over ``steps`` (after 2 untimed), and the values read to
    the host in a step (``aten::_local_scalar_dense``: ``.item()``, ``float()``, ``bool()``), counted by torch's
    profiler in the second untimed step (the profiler slows the step it records)."""
    times, reads = [], 0
    for i in range(steps + 2):
        image, label = batch(patches, roi, meta)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if i == 1 else nullcontext() as p:
            start = time.perf_counter()
            loss_fn(network(image), label).backward()
            elapsed = time.perf_counter() - start
        if i == 1:
            reads = sum(e.count for e in p.key_averages() if e.key == "aten::_local_scalar_dense")
        elif i >= 2:
            times.append(elapsed * 1e3)
    return statistics.median(times), reads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--feature_size", type=int, default=48)
    parser.add_argument("--patches", type=int, default=4)
    parser.add_argument("--roi", type=int, default=96)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    network = SwinUNETR(in_channels=1, out_channels=2, feature_size=args.feature_size, spatial_dims=3).to("meta")
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False, batch=True)
    print(f"SwinUNETR f{args.feature_size}, {args.patches} x {args.roi}^3, forward + loss + backward on the meta "
          f"device; median of {args.steps} steps; the MetaTensor with a NIfTI CT's metadata")  # fmt: skip
    print("| batch | host ms/step (meta device) | values read to the host a step |\n|---|---|---|")
    meta, rows = nifti_metadata(args.roi), {}
    for name, metadata in (("MetaTensor (default_prepare_batch)", meta), ("plain (plain_tensor_batch)", None)):
        rows[name] = host_ms(network, loss_fn, args.patches, args.roi, metadata, args.steps)
        print(f"| {name} | {rows[name][0]:.1f} | {rows[name][1]:.0f} |")
    (meta_ms, _), (plain_ms, _) = rows.values()
    print(f"the MetaTensor batch costs the host {meta_ms - plain_ms:.1f} ms a step (the rows' difference; the meta "
          "device's own shape functions are in both)")  # fmt: skip


if __name__ == "__main__":
    main()
