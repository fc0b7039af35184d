"""Pictures of a segmentation: the axial CT slice through the structure, truth contour green, prediction red.

:func:`render_case` draws two panels -- the whole slice and a zoom on the structure -- in the radiological
convention (patient's right on the left of the image, anterior at the top), whatever the volume's orientation.
:class:`ValidationPicture` logs the same picture of the first validation case to TensorBoard at every validation,
so training can be watched as well as scored.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence

import nibabel as nib
import numpy as np
from ignite.engine import Engine, Events
from scipy import ndimage
from scripts.inference.contours import mean_index
from scripts.inference.records import label_map, merged_items
from scripts.training.distributed import is_rank0

logger = logging.getLogger(__name__)

TRUTH_RGB = (40, 220, 40)
PRED_RGB = (255, 60, 60)
BOTH_RGB = (255, 230, 40)
MIN_PANEL = 256  # pixels: smaller slices are enlarged (nearest neighbour)


def to_lps(volume: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """``volume`` [X, Y, Z] with voxel axes reordered/flipped to point L, P, S (axial slices are ``[:, :, k]``)."""
    return nib.orientations.apply_orientation(volume, _lps_orientation(affine))


def _lps_orientation(affine: np.ndarray) -> np.ndarray:
    orientations = nib.orientations
    return orientations.ornt_transform(orientations.io_orientation(affine), orientations.axcodes2ornt("LPS"))


def render_case(
    ct: np.ndarray | None,
    truth: np.ndarray,
    pred: np.ndarray,
    affine: np.ndarray,
    window: Sequence[float] = (-1000, 500),
    title: str = "",
) -> np.ndarray:
    """An RGB ``uint8`` picture of the axial slice with the most truth (else prediction) voxels.

    ``ct`` (HU, or any intensity shown through ``window``) may be None: the masks are then drawn on black.
    """
    truth, pred = to_lps(np.asarray(truth) > 0, affine), to_lps(np.asarray(pred) > 0, affine)
    low, high = float(window[0]), float(window[1])
    ct = np.full(truth.shape, low, np.float32) if ct is None else to_lps(np.asarray(ct, dtype=np.float32), affine)
    area = truth.sum((0, 1)) if truth.any() else pred.sum((0, 1))
    k = int(area.argmax()) if area.any() else truth.shape[2] // 2

    gray = (np.clip((ct[:, :, k].T - low) / max(high - low, 1e-6), 0, 1) * 255).astype(np.uint8)
    rgb = np.repeat(gray[..., None], 3, axis=-1)
    t_edge, p_edge = _edge(truth[:, :, k].T), _edge(pred[:, :, k].T)
    rgb[t_edge] = TRUTH_RGB
    rgb[p_edge] = PRED_RGB
    rgb[t_edge & p_edge] = BOTH_RGB

    union = truth[:, :, k].T | pred[:, :, k].T
    zoom = rgb
    if union.any():
        rows, cols = np.nonzero(union)
        margin = 12
        r0, r1 = max(rows.min() - margin, 0), min(rows.max() + margin + 1, rgb.shape[0])
        c0, c1 = max(cols.min() - margin, 0), min(cols.max() + margin + 1, rgb.shape[1])
        zoom = rgb[r0:r1, c0:c1]
    small = max(1, -(-MIN_PANEL // rgb.shape[0]))  # small volumes (the demo's) are enlarged to stay readable
    rgb = rgb.repeat(small, 0).repeat(small, 1)
    if zoom.shape[0] < rgb.shape[0]:
        factor = max(1, rgb.shape[0] // zoom.shape[0])
        zoom = zoom.repeat(factor, 0).repeat(factor, 1)
    height = max(rgb.shape[0], zoom.shape[0])
    panels = [np.pad(p, ((0, height - p.shape[0]), (0, 4), (0, 0))) for p in (rgb, zoom)]
    picture = np.concatenate(panels, axis=1)
    return _caption(picture, [f"{title}  axial slice {k}", "truth: green  prediction: red  both: yellow"])


def png_bytes(rgb: np.ndarray) -> bytes:
    """PNG encoding of an RGB ``uint8`` array."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def _edge(mask: np.ndarray) -> np.ndarray:
    return mask & ~ndimage.binary_erosion(mask) if mask.any() else mask


def _caption(picture: np.ndarray, lines: Sequence[str]) -> np.ndarray:
    from PIL import Image, ImageDraw

    bar = np.zeros((14 * len(lines) + 4, picture.shape[1], 3), np.uint8)
    image = Image.fromarray(np.concatenate([bar, picture], axis=0))
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((4, 2 + 14 * i), line, fill=(255, 255, 255))
    return np.asarray(image)


class ValidationPicture:
    """Evaluator handler: the first validation case's picture to TensorBoard (tag ``validation/<case>``).

    Works on the evaluator's post-processed output in the training grid: ``image`` scaled to [0, 1] (so the window
    is (0, 1)), ``label`` and ``pred`` one-hot.
    """

    def __init__(self, log_dir: str, image_key: str = "image", label_key: str = "label", enabled: bool | None = None):
        self.log_dir, self.image_key, self.label_key = log_dir, image_key, label_key
        self.enabled = is_rank0() if enabled is None else enabled  # None: rank 0 of a DDP run only
        self._writer = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=1), self)

    def __call__(self, engine: Engine) -> None:
        if not self.enabled:
            return
        item = merged_items(engine)[0]
        image, label, pred = (item[k] for k in (self.image_key, self.label_key, "pred"))
        # the training grid is RAS (Orientationd); GPU-cached data carries no metadata, so fall back to that
        affine = np.asarray(image.affine, dtype=float) if hasattr(image, "affine") else np.eye(4)
        ct = np.asarray(image.detach().cpu())[0]
        rgb = render_case(ct, label_map(label), label_map(pred), affine, (0.0, 1.0), "validation")
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        case_id = item.get("case_id", "case")
        self._writer.add_image(f"validation/{case_id}", rgb, global_step=engine.state.epoch, dataformats="HWC")
        self._writer.flush()


def render_planes(
    ct: np.ndarray | None,
    labels: np.ndarray,
    affine: np.ndarray,
    centre_lps: Sequence[float] | None = None,
    window: Sequence[float] = (-1000, 500),
    title: str = "",
    colours: Sequence[Sequence[int]] = (PRED_RGB, TRUTH_RGB, (80, 160, 255), (255, 160, 0), (200, 80, 255)),
) -> np.ndarray:
    """An RGB ``uint8`` picture of the axial, coronal and sagittal planes through ``centre_lps`` (default: the centre
    of label 1, else of any label) with each label's outline drawn on the CT, label ``i`` in ``colours[i - 1]``.

    Radiological convention whatever the volume's orientation: the patient's right on the image's left (axial,
    coronal), anterior on the left (sagittal), anterior (axial) or head (coronal, sagittal) at the top; each plane is
    scaled to square millimetres, so 3 mm slices are not squashed.
    """
    labels_lps = to_lps(np.asarray(labels), affine)
    ct = np.zeros(labels_lps.shape, np.float32) if ct is None else to_lps(np.asarray(ct), affine)
    lps_affine = affine @ nib.orientations.inv_ornt_aff(_lps_orientation(affine), np.asarray(labels).shape)
    spacing = np.linalg.norm(lps_affine[:3, :3], axis=0)
    if centre_lps is not None:
        ras = np.asarray(centre_lps, dtype=float) * [-1, -1, 1]
        centre = np.linalg.solve(lps_affine[:3, :3], ras - lps_affine[:3, 3])
    else:
        mask = labels_lps == 1 if (labels_lps == 1).any() else labels_lps > 0
        centre = mean_index(mask) if mask.any() else np.array(mask.shape) / 2
    i, j, k = (int(np.clip(round(float(c)), 0, n - 1)) for c, n in zip(centre, labels_lps.shape, strict=True))
    axial, coronal, sagittal = (np.asarray(p, np.float32) for p in (ct[:, :, k], ct[:, j, :], ct[i, :, :]))  # 3 only
    planes = [  # (CT plane, label plane, mm per row, mm per column, name): rows top to bottom, columns left to right
        (axial.T, labels_lps[:, :, k].T, spacing[1], spacing[0], f"axial {k}"),
        (coronal.T[::-1], labels_lps[:, j, :].T[::-1], spacing[2], spacing[0], f"coronal {j}"),
        (sagittal.T[::-1], labels_lps[i, :, :].T[::-1], spacing[2], spacing[1], f"sagittal {i}"),
    ]
    low, high = float(window[0]), float(window[1])
    pixel_mm = picture_pixel_mm(spacing, labels_lps.shape)
    panels = []
    for image, label, row_mm, col_mm, _ in planes:
        image, label = (_square_mm(a, row_mm, col_mm, pixel_mm) for a in (image, label))
        gray = (np.clip((image - low) / max(high - low, 1e-6), 0, 1) * 255).astype(np.uint8)
        rgb = np.repeat(gray[..., None], 3, axis=-1)
        for value in np.unique(label[label > 0]):
            rgb[_edge(label == value)] = colours[(int(value) - 1) % len(colours)]
        panels.append(rgb)
    height = max(p.shape[0] for p in panels)
    picture = np.concatenate([np.pad(p, ((0, height - p.shape[0]), (0, 4), (0, 0))) for p in panels], axis=1)
    names = "  ".join(p[4] for p in planes)
    return _caption(picture, [f"{title}  {names}", "patient's right on the image's left (axial, coronal)"])


#: a panel's longest side in pixels: at least LARGEST_SIDE[0] (a small volume is enlarged, so its picture can be read
#: in a report or a README), at most LARGEST_SIDE[1] (a large one is reduced); in between, a pixel per finest voxel
LARGEST_SIDE = (384, 512)


def picture_pixel_mm(spacing: Sequence[float], shape: Sequence[int]) -> float:
    """The millimetres per picture pixel of :func:`render_planes` for a volume of ``shape`` voxels of ``spacing`` mm
    (radiological axes): the finest voxel size, unless the longest side would then fall outside
    :data:`LARGEST_SIDE` pixels."""
    extent = float(np.max(np.asarray(spacing, float) * np.asarray(shape)))
    return max(min(float(np.min(spacing)), extent / LARGEST_SIDE[0]), extent / LARGEST_SIDE[1])


def _square_mm(plane: np.ndarray, row_mm: float, col_mm: float, pixel_mm: float) -> np.ndarray:
    """``plane`` resampled (nearest neighbour) to square pixels of ``pixel_mm``."""
    rows = np.minimum(((np.arange(round(plane.shape[0] * row_mm / pixel_mm)) + 0.5) * pixel_mm / row_mm).astype(int),
                      plane.shape[0] - 1)  # fmt: skip
    cols = np.minimum(((np.arange(round(plane.shape[1] * col_mm / pixel_mm)) + 0.5) * pixel_mm / col_mm).astype(int),
                      plane.shape[1] - 1)  # fmt: skip
    return plane[np.ix_(rows, cols)]
