"""The analytic estimator against hand-computed examples from the literature (pure, no torch)."""

from __future__ import annotations

import pytest

from gpumemd.analysis.memory_estimate import GIB, TransformerShape, estimate, peak_bytes, transformer_activation_bytes
from gpumemd.analysis.model_state import bytes_per_param


def model_state(est):  # weights + gradients + optimizer state, per GPU
    return est.weights_bytes + est.gradients_bytes + est.optimizer_state_bytes


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_7b_adam_mixed_precision_is_16_bytes_per_param_112_gb(precision: str) -> None:
    est = estimate(7_000_000_000, precision=precision, optimizer="adamw")
    assert model_state(est) == 112_000_000_000  # 2 + 2 + 12 bytes/param (ZeRO §3.1)
    assert est.weights_bytes == 14_000_000_000  # "a 7B model in fp16 is 14 GB"
    assert est.optimizer_state_bytes == 84_000_000_000  # K = 12: fp32 master + momentum + variance
    assert est.dominant == "optimizer_state"


def test_zero_paper_figure_1_7_5b_on_64_gpus() -> None:
    # ZeRO (Rajbhandari et al. 2020), Figure 1: Ψ = 7.5B, K = 12, Nd = 64 -> 120, 31.4, 16.6, 1.9 GB.
    expected = {0: 120e9, 1: 31.40625e9, 2: 16.640625e9, 3: 1.875e9}
    for stage, figure in expected.items():
        est = estimate(7_500_000_000, precision="fp16-mixed", optimizer="adam", gpus=64, zero_stage=stage)
        assert model_state(est) == int(figure), stage


@pytest.mark.parametrize(
    ("precision", "optimizer", "total"),
    [
        ("fp32", "adam", 16),  # 4 + 4 + 8
        ("fp32", "sgd", 8),
        ("fp32", "sgd-momentum", 12),  # HF: momentum 4 bytes/param
        ("fp32", "adam-8bit", 10),  # HF: 8-bit AdamW 2 bytes/param
        ("fp32", "lion", 12),
        ("bf16", "adamw", 8),  # state in bf16 like torch.optim's zeros_like(param)
        ("bf16-mixed", "adam-8bit", 10),  # 2 + 2 + (4 master + 2)
        ("bf16-mixed", "lion", 12),
        ("bf16-mixed", "sgd", 8),
    ],
)
def test_bytes_per_param_table(precision: str, optimizer: str, total: int) -> None:
    per = bytes_per_param(precision, optimizer)
    assert per.weights + per.gradients + per.optimizer_state == total


def test_korthikanti_eq1_per_layer_activations() -> None:
    # s=2048, b=1, h=12288, a=96 (GPT-3 175B shape): s·b·h·(34 + 5·a·s/h) = 25165824 · 114
    shape = TransformerShape(layers=1, hidden=12288, heads=96, seq=2048, batch=1)
    assert transformer_activation_bytes(shape, "bf16-mixed") == 2048 * 12288 * (34 + 80)
    flash = TransformerShape(layers=1, hidden=12288, heads=96, seq=2048, batch=1, flash=True)
    assert transformer_activation_bytes(flash, "bf16") == 2048 * 12288 * 34 + 4 * 96 * 2048
    # fp32 activations: 16·4 + 2 bytes per s·b·h element and 2·4 + 1 per attention-score element
    assert transformer_activation_bytes(shape, "fp32") == 2048 * 12288 * 66 + 96 * 2048 * 2048 * 9


def test_checkpointing_keeps_layer_inputs_plus_one_layer() -> None:
    full = TransformerShape(layers=24, hidden=1024, heads=16, seq=1024, batch=4)
    ckpt = TransformerShape(layers=24, hidden=1024, heads=16, seq=1024, batch=4, checkpointing=True)
    one_layer = transformer_activation_bytes(
        TransformerShape(layers=1, hidden=1024, heads=16, seq=1024, batch=4), "bf16-mixed"
    )
    assert transformer_activation_bytes(full, "bf16-mixed") == 24 * one_layer
    assert transformer_activation_bytes(ckpt, "bf16-mixed") == 2 * 1024 * 4 * 1024 * 24 + one_layer


def test_gpt2_small_parameter_count() -> None:
    shape = TransformerShape(layers=12, hidden=768, heads=12, seq=1024, batch=1, vocab=50257)
    assert shape.parameters == 124_439_808  # the published GPT-2 small count (tied head)
    assert estimate(precision="fp32", optimizer="adamw", shape=shape).params == 124_439_808


def test_peak_is_the_hugging_face_rule() -> None:
    assert peak_bytes(10, 20, 5, 3, 7) == 10 + 20 + 8
    assert peak_bytes(10, 20, 5, 3, 100) == 10 + 20 + 100
    shape = TransformerShape(layers=32, hidden=4096, heads=32, seq=4096, batch=8)
    est = estimate(7_000_000_000, precision="bf16-mixed", optimizer="adamw", shape=shape)
    assert est.activations_bytes is not None
    assert est.peak_bytes == est.weights_bytes + est.optimizer_state_bytes + max(
        est.gradients_bytes + est.optimizer_intermediates_bytes, est.activations_bytes
    )
    assert est.dominant == "activations"  # seq² attention scores at batch 8
    assert not any(d.fits for d in est.devices)


def test_device_fit_and_headroom() -> None:
    est = estimate(1_000_000_000, precision="bf16-mixed", optimizer="adamw")  # 20 bytes/param peak
    assert est.peak_bytes == 20_000_000_000
    fits = {d.name: d.fits for d in est.devices}
    assert fits == {"16 GiB": False, "24 GiB": True, "40 GiB": True, "48 GiB": True, "80 GiB": True,
                    "141 GiB": True}
    assert est.devices[1].headroom_bytes == 24 * GIB - 20_000_000_000


def test_offload_moves_terms_to_host() -> None:
    base = estimate(1_000_000_000, precision="bf16-mixed", optimizer="adam", gpus=8, zero_stage=2)
    off = estimate(1_000_000_000, precision="bf16-mixed", optimizer="adam", gpus=8, zero_stage=2,
                   offload="optimizer")
    assert off.optimizer_state_bytes == 0
    assert off.host_bytes == base.optimizer_state_bytes + base.optimizer_intermediates_bytes
    full = estimate(1_000_000_000, precision="bf16-mixed", optimizer="adam", gpus=8, zero_stage=3,
                    offload="params")
    assert full.weights_bytes == full.gradients_bytes == 0
    # (2 weights + 2 grads + 12 state + 4 intermediates) bytes/param, sharded 8 ways, all on the host
    assert full.host_bytes == 20 * 10**9 // 8


def test_stage3_counts_two_unsharded_layers_when_shape_known() -> None:
    shape = TransformerShape(layers=32, hidden=4096, heads=32, seq=2048, batch=1, flash=True)
    est = estimate(7_000_000_000, precision="bf16-mixed", optimizer="adamw", gpus=8, zero_stage=3, shape=shape)
    assert est.gather_bytes == 2 * (12 * 4096**2 + 13 * 4096) * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": 0}, "params=0"),
        ({"params": 10, "precision": "fp8"}, "precision='fp8'"),
        ({"params": 10, "optimizer": "adagrad"}, "optimizer='adagrad'"),
        ({"params": 10, "gpus": 0}, "gpus=0"),
        ({"params": 10, "zero_stage": 4}, "zero_stage=4"),
        ({"params": 10, "offload": "params", "zero_stage": 2}, "needs zero_stage=3"),
        ({}, "params is missing"),
    ],
)
def test_bad_inputs_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        estimate(**kwargs)


def test_bad_transformer_shape() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        TransformerShape(layers=2, hidden=100, heads=3, seq=8, batch=1)
    with pytest.raises(ValueError, match="seq=0"):
        TransformerShape(layers=2, hidden=96, heads=3, seq=0, batch=1)
