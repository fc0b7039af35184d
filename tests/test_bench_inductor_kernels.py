"""benchmarks.inductor_kernels: inductor's Triton kernels read for what decides their memory traffic -- persistent or
looped (and how many passes over the row), gathers through an index, atomic adds -- on the output code torch's
inductor wrote for a Swin block (tests/data/inductor/), and, where the triton package is installed, written afresh."""

from __future__ import annotations

import pytest
from benchmarks.inductor_kernels import kernels_in, main
from conftest import ROOT

FIXTURE = ROOT / "tests" / "data" / "inductor" / "swin_block_kernels.py.txt"


def _sections() -> dict[str, dict[str, object]]:
    text = FIXTURE.read_text()
    _, monai, dense = text.split("# ---- ")
    return {"monai": {k.name: k for k in kernels_in(monai)}, "dense": {k.name: k for k in kernels_in(dense)}}


def test_monais_attention_softmax_is_three_passes_that_gather_the_bias():
    kernels = _sections()["monai"]
    forward = kernels["triton_red_fused__softmax__to_copy_add_clone_index_permute_unsqueeze_view_12"]
    assert not forward.persistent and forward.passes == 3, "max, sum, normalise: the row read three times"
    assert forward.indirect_loads == 2, "the bias gathered through the index in the first two passes"
    window_sum = kernels[
        "triton_per_fused__softmax_backward_data__to_copy_index_put_new_zeros_permute_squeeze_sum_view_14"
    ]
    assert window_sum.atomic_adds == 1 and window_sum.indirect_loads == 1, "the gradient scattered into the table"
    norm = kernels["triton_per_fused_native_layer_norm_6"]
    assert norm.persistent and norm.passes == norm.indirect_loads == norm.atomic_adds == 0


def test_the_dense_bias_softmax_is_one_pass_without_a_gather():
    kernels = _sections()["dense"]
    forward = kernels["triton_per_fused__softmax__to_copy_add_unsqueeze_view_11"]
    assert forward.persistent and forward.passes == 0 and forward.indirect_loads == 0
    assert sum(k.atomic_adds for k in kernels.values()) == 1, "the table's gradient: still one scatter, after the sum"


def test_the_kernels_written_afresh_say_the_same(capsys):
    """Inductor run here (Triton written on the CPU, its compile failing as expected): the first stage's block."""
    pytest.importorskip("triton")
    (_, monai), (_, dense) = main(["--patches", "1"])
    assert (monai[0].persistent, monai[0].passes, monai[0].indirect_loads) == (False, 3, 2), "the forward softmax"
    assert (dense[0].persistent, dense[0].passes, dense[0].indirect_loads) == (True, 0, 0)
    assert "DenseBiasWindowAttention (1 patch(es), plain windows)" in capsys.readouterr().out
