"""``gpumemd estimate``: the documented invocations, --json integers, one-line errors with exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from gpumemd.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def assert_integer_bytes(doc: dict) -> None:
    for name, value in doc["per_gpu_bytes"].items():
        assert type(value) is int, name
    for key in ("peak_bytes", "host_bytes", "params"):
        assert type(doc[key]) is int, key
    for device in doc["devices"]:
        assert type(device["capacity_bytes"]) is int and type(device["headroom_bytes"]) is int


def test_params_invocation_as_documented(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7e9", "--precision", "bf16-mixed", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 parameters" in out and "dominant term: optimizer state" in out
    doc = run_json(capsys, "--params", "7e9", "--precision", "bf16-mixed", "--optimizer", "adamw")
    assert_integer_bytes(doc)
    terms = doc["per_gpu_bytes"]
    assert terms["weights"] + terms["gradients"] + terms["optimizer_state"] == 112_000_000_000
    assert doc["mode"] == "params" and doc["activations_known"] is False


def test_zero_fsdp_and_shape_options(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--params", "7.5e9", "--precision", "fp16-mixed", "--optimizer", "adam",
                   "--gpus", "64", "--fsdp", "full")
    assert doc["zero_stage"] == 3
    t = doc["per_gpu_bytes"]
    assert t["weights"] + t["gradients"] + t["optimizer_state"] == 1_875_000_000  # ZeRO Figure 1
    doc = run_json(capsys, "--params", "7e9", "--precision", "bf16-mixed", "--layers", "32", "--hidden",
                   "4096", "--heads", "32", "--seq", "4096", "--batch", "1", "--flash")
    assert doc["activations_known"] is True and doc["per_gpu_bytes"]["activations"] > 0
    assert_integer_bytes(doc)


def test_model_invocation_as_documented(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "estimate_models:mlp", "--input-shape", "32,100",
                 "--optimizer", "adam"]) == 0
    out = capsys.readouterr().out
    assert "traced" in out and "analytic" in out
    doc = run_json(capsys, "--model", "estimate_models:mlp", "--input-shape", "32,100", "--optimizer", "adam")
    assert doc["mode"] == "model"
    traced = doc["traced"]
    assert traced["saved_for_backward_bytes"] == 4 * (32 * 100 + 3 * 32 * 256)
    assert all(type(v) is int for k, v in traced.items() if k.endswith("_bytes"))
    assert traced["peak_bytes"] == (traced["parameter_bytes"] + traced["buffer_bytes"]
                                    + traced["optimizer_state_bytes"]
                                    + max(traced["gradient_bytes"] + traced["optimizer_intermediates_bytes"],
                                          traced["saved_for_backward_bytes"]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "no_such_pkg_xyz.mod:f", "--input-shape", "4,4"], "cannot import 'no_such_pkg_xyz.mod'"),
        (["--model", "estimate_models:broken", "--input-shape", "4,32"],
         "failed on the meta device on an input of shape (4, 32)"),
        (["--model", "estimate_models:mlp", "--input-shape", "32,0"], "input shape '32,0' is not valid"),
        (["--model", "estimate_models:mlp", "--input-shape", "a,b"], "input shape 'a,b' is not valid"),
        (["--model", "estimate_models:mlp"], "--model needs --input-shape"),
        (["--params", "-5"], "--params='-5' is not valid"),
        (["--params", "lots"], "--params='lots' is not valid"),
        ([], "give exactly one of --params"),
        (["--params", "1e9", "--model", "estimate_models:mlp"], "give exactly one of --params"),
        (["--params", "1e9", "--layers", "2"], "missing --hidden --heads --seq --batch"),
        (["--params", "1e9", "--gpus", "0"], "--gpus=0 is not valid"),
        (["--params", "1e9", "--zero", "1", "--fsdp", "full"], "disagree"),
        (["--params", "1e9", "--offload", "params"], "needs zero_stage=3"),
    ],
)
def test_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["estimate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("gpumemd estimate: ") and message in err


def test_module_does_not_import_torch() -> None:
    code = "import sys, gpumemd.cli.estimate, gpumemd.analysis.memory_estimate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_params_from_shape_and_mixed_precision_trace(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--layers", "12", "--hidden", "768", "--heads", "12", "--seq", "1024", "--batch", "1",
                   "--vocab", "50257")
    assert doc["params"] == 124_439_808  # GPT-2 small
    doc = run_json(capsys, "--model", "estimate_models:sdpa", "--input-shape", "2,64,64", "--precision",
                   "bf16-mixed", "--optimizer", "adamw")
    assert doc["traced"]["precision"] == "bf16-mixed"
    meta = run_json(capsys, "--model", "estimate_models:sdpa", "--input-shape", "2,64,64")
    fake = run_json(capsys, "--model", "estimate_models:sdpa", "--input-shape", "2,64,64",
                    "--trace-backend", "fake-cpu")
    assert fake["traced"]["saved_for_backward_bytes"] < meta["traced"]["saved_for_backward_bytes"]


def test_subtotal_before_activations_is_printed_and_returned(capsys: pytest.CaptureFixture[str]) -> None:
    """The seed's headline: weights + gradients + optimizer state = 16 B/param = 112 GB for 7B in
    bf16-mixed AdamW."""
    argv = ["estimate", "--params", "7e9", "--precision", "bf16-mixed", "--optimizer", "adamw"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["before_activations_bytes"] == 112_000_000_000
    assert main(argv) == 0
    assert "before activations (weights + gradients + optimizer state): 104.31 GiB per GPU, 16.0 B/param " \
           "(112.0 GB)" in capsys.readouterr().out
    assert main([*argv, "--gpus", "8", "--zero", "3"]) == 0
    assert "per GPU (sharded / offloaded)" in capsys.readouterr().out
    assert main(["estimate", "--params", "2e6", "--optimizer", "adamw"]) == 0
    assert "30.52 MiB per GPU, 16.0 B/param\n" in capsys.readouterr().out  # no "(0.0 GB)"


def test_explain_says_what_each_row_is_and_why_the_peak_adds_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7e9", "--precision", "bf16-mixed", "--optimizer", "adamw", "--explain"]) == 0
    out = capsys.readouterr().out
    rows = {re.split(r" \(|: ", line)[0]: line for line in out.split("\n\n")[-1].splitlines()}
    assert set(rows) == {"weights", "gradients", "optimizer state", "optimizer intermediates", "activations",
                         "peak = weights + optimizer state + max(gradients + optimizer intermediates, activations)"}
    intermediates = rows["optimizer intermediates"]
    assert intermediates.startswith("optimizer intermediates (4 B/param): the temporaries of one optimizer.step(): ")
    assert "sqrt(exp_avg_sq)" in intermediates and "the peak adds them to the gradients" in intermediates
    assert rows["optimizer state"].startswith("optimizer state (12 B/param): ")
    assert "fp32 master weights (4 B/param)" in rows["optimizer state"]
    sharded = run_json(capsys, "--params", "7e9", "--precision", "bf16-mixed", "--gpus", "8", "--zero", "1",
                       "--explain")
    assert any("Divided over the 8 GPUs (ZeRO stage 1)." in line for line in sharded["explain"])


def test_grad_dtype_sets_the_gradients_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    base = run_json(capsys, "--params", "7e9", "--precision", "bf16-mixed")
    fp32 = run_json(capsys, "--params", "7e9", "--precision", "bf16-mixed", "--grad-dtype", "fp32")
    assert base["per_gpu_bytes"]["gradients"] == 14_000_000_000 and base["grad_dtype"] is None
    assert fp32["per_gpu_bytes"]["gradients"] == 28_000_000_000 and fp32["grad_dtype"] == "fp32"
    assert fp32["peak_bytes"] - base["peak_bytes"] == 14_000_000_000  # gradients + intermediates grew by 2 B/param
    assert main(["estimate", "--params", "7e9", "--precision", "bf16-mixed", "--grad-dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("7,000,000,000 parameters, bf16-mixed, fp32 gradients, adamw, ")
    assert "18.0 B/param" in out
    assert main(["estimate", "--params", "7e9", "--grad-dtype", "fp8"]) == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
