"""Random-number state that survives a checkpoint: after ``capture`` -> ``torch.save`` ->
``torch.load(weights_only=True)`` -> ``restore`` into a freshly built pipeline (another process: other seeds), torch,
numpy, Python ``random`` and every transform generator -- nested Composes and helpers such as
RandCropByPosNegLabeld's cropper included -- draw exactly what an uninterrupted run draws next. A pipeline with other
generators is told apart (False) and its generators are left alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from monai.transforms import Compose, RandCropByPosNegLabeld, RandFlipd, RandGaussianNoised, RandScaleIntensityd
from scripts.training.rng import capture, random_generators, restore


def pipeline(seed: int) -> Compose:
    """An augmentation pipeline like the bundle's: a crop with its own helper, a flip, and a nested Compose."""
    transforms = Compose(
        [
            RandCropByPosNegLabeld(
                keys=["image", "label"], label_key="label", spatial_size=(4, 4, 4), pos=1, neg=1, num_samples=2
            ),
            RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
            Compose([RandGaussianNoised(keys="image", prob=1.0, std=0.5), RandScaleIntensityd("image", 0.3, 0.5)]),
        ]
    )
    transforms.set_random_state(seed=seed)
    return transforms


def case() -> dict:
    image = torch.arange(12**3, dtype=torch.float32).reshape(1, 12, 12, 12) / 100
    label = torch.zeros(1, 12, 12, 12)
    label[0, 3:6, 4:8, 2:5] = 1
    return {"image": image, "label": label}


def step(transforms) -> list[np.ndarray]:
    """One training step's worth of random draws: every global generator (leaving a cached Gaussian in numpy and
    Python ``random``) and the augmentation of a case."""
    draws = [torch.rand(3).numpy(), np.random.randn(1), np.array([random.gauss(0, 1), random.random()])]
    items = transforms(case()) if isinstance(transforms, Compose) else apply_list(transforms, case())
    for item in items if isinstance(items, list) else [items]:
        draws += [np.asarray(item["image"]), np.asarray(item["label"])]
    return draws


def apply_list(transforms: list, data: dict) -> dict:
    for t in transforms:
        data = t(data)
    return data


def seed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def assert_same_draws(expected: list[list[np.ndarray]], actual: list[list[np.ndarray]]) -> None:
    assert len(expected) == len(actual)
    for s, (a, b) in enumerate(zip(expected, actual, strict=True)):
        assert len(a) == len(b), f"step {s}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            np.testing.assert_array_equal(x, y, err_msg=f"step {s}, draw {i}")


def through_a_file(state: dict, tmp_path) -> dict:
    torch.save(state, tmp_path / "rng.pt")
    return torch.load(tmp_path / "rng.pt", weights_only=True)


def test_restored_state_continues_the_uninterrupted_sequence(tmp_path):
    seed_globals(0)
    straight = pipeline(seed=0)
    uninterrupted = [step(straight) for _ in range(4)]

    seed_globals(0)
    first = pipeline(seed=0)
    assert_same_draws(uninterrupted[:2], [step(first) for _ in range(2)])
    saved = through_a_file(capture(random_generators(first)), tmp_path)

    seed_globals(999)  # a new process: other global seeds, a pipeline with another seed, some draws already made
    second = pipeline(seed=7)
    step(second)
    assert restore(saved, random_generators(second)) is True
    assert_same_draws(uninterrupted[2:], [step(second) for _ in range(2)])


def test_without_restore_the_sequence_differs(tmp_path):
    """The control for the test above: the fresh pipeline does not happen to draw the same by itself."""
    seed_globals(0)
    straight = pipeline(seed=0)
    uninterrupted = [step(straight) for _ in range(3)]
    seed_globals(999)
    second = pipeline(seed=7)
    with pytest.raises(AssertionError):
        assert_same_draws(uninterrupted[2:], [step(second)])


@pytest.mark.parametrize("which", ["torch", "numpy", "python", "transforms"])
def test_each_generator_is_needed_for_an_exact_continuation(tmp_path, which):
    seed_globals(0)
    first = pipeline(seed=0)
    step(first)
    saved = capture(random_generators(first))
    expected = step(first)

    seed_globals(999)
    second = pipeline(seed=7)
    partial = {k: v for k, v in saved.items() if k != which}
    restore(partial, random_generators(second) if which != "transforms" else [])
    with pytest.raises(AssertionError):
        assert_same_draws([expected], [step(second)])


def test_generators_of_nested_composes_and_helpers_are_found():
    transforms = pipeline(seed=0)
    crop, flip, nested = transforms.transforms
    found = random_generators(transforms)
    owners = [crop, crop.cropper, flip, *nested.transforms]
    for owner in owners:
        assert any(g is owner.R for g in found), f"the generator of {type(owner).__name__} is captured"
    assert len({id(g) for g in found}) == len(found), "each generator once"
    # a second pipeline built the same way lists its generators in the same order (their states line up)
    again = random_generators(pipeline(seed=0))
    assert [g.get_state()[1].tolist() for g in found] == [g.get_state()[1].tolist() for g in again]


def test_list_of_transforms_outside_a_compose_continues_exactly(tmp_path):
    """Transforms never seeded by a Compose draw from MONAI's class-level generator; a list of them is accepted by
    ``TrainingCheckpoint(transforms=...)``, so that generator must be captured too."""

    def bare() -> list:
        return [RandGaussianNoised(keys="image", prob=1.0, std=0.5), RandFlipd(keys="image", prob=0.5)]

    seed_globals(0)
    first = bare()
    step(first)
    saved = through_a_file(capture(random_generators(first)), tmp_path)
    expected = [step(first) for _ in range(2)]

    seed_globals(999)
    second = bare()
    step(second)
    assert restore(saved, random_generators(second)) is True
    assert_same_draws(expected, [step(second) for _ in range(2)])


def test_captured_state_is_tensors_and_plain_values_only(tmp_path):
    seed_globals(0)
    random.gauss(0, 1)  # Python's random then holds a cached Gaussian (a float, not None)
    np.random.randn(1)  # and numpy too
    state = capture(random_generators(pipeline(seed=0)))
    loaded = through_a_file(state, tmp_path)  # weights_only=True refuses anything else
    assert loaded.keys() == {"torch", "numpy", "python", "transforms"}
    assert isinstance(loaded["python"]["gauss"], float)
    assert float(loaded["numpy"]["meta"][0]) >= 0 and int(loaded["numpy"]["meta"][1]) == 1


def test_mismatched_generator_list_returns_false_and_leaves_them_alone():
    seed_globals(0)
    saved = capture(random_generators(pipeline(seed=0)))
    expected_torch = torch.rand(2)

    others = [np.random.RandomState(5), np.random.RandomState(6)]
    before = [g.get_state() for g in others]
    torch.manual_seed(42)
    assert restore(saved, others) is False
    for g, state in zip(others, before, strict=True):
        after = g.get_state()
        np.testing.assert_array_equal(after[1], state[1])
        assert after[2:] == state[2:]
    assert torch.equal(torch.rand(2), expected_torch), "the global generators are still restored"
