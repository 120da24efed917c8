"""The meta-device trace against real CPU training steps of the same models."""

from __future__ import annotations

import gc
import weakref

import estimate_models as em
import pytest
import torch

from gpumemd.probes.planning.trace import (
    SavedTensorCounter,
    TraceError,
    load_factory,
    parse_shape,
    scalar_loss,
    trace_model,
)

MODELS = sorted(em.INPUTS)
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adafactor": torch.optim.Adafactor,
}


def make_input(name: str) -> torch.Tensor:
    shape, dtype = em.INPUTS[name]
    if dtype == "int64":
        return torch.randint(0, 128, shape)
    return torch.randn(shape)


def real_step(name: str, optimizer: str) -> dict[str, int]:
    """One real CPU training step; the exact terms read from the live objects."""
    torch.manual_seed(0)
    model = getattr(em, name)()
    opt = OPTIMIZERS[optimizer](model.parameters())
    counter = SavedTensorCounter(exclude=[*model.parameters(), *model.buffers()])
    with counter:
        loss = scalar_loss(model(make_input(name)))
    loss.backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.nbytes for p in model.parameters()),
        "buffer_bytes": sum(b.nbytes for b in model.buffers()),
        "gradient_bytes": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "optimizer_state_bytes": sum(t.nbytes for t in state),
        "saved": counter.bytes,
    }


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_model_state_is_exact(name: str, optimizer: str) -> None:
    shape, dtype = em.INPUTS[name]
    traced = trace_model(getattr(em, name), shape, input_dtype=dtype, optimizer=optimizer)
    real = real_step(name, optimizer)
    assert traced.parameters == real["params"]
    assert traced.parameter_bytes == real["parameter_bytes"]
    assert traced.buffer_bytes == real["buffer_bytes"]
    assert traced.gradient_bytes == real["gradient_bytes"]
    assert traced.optimizer_state_bytes == real["optimizer_state_bytes"]


@pytest.mark.parametrize("name", MODELS)
def test_saved_for_backward_matches_a_real_step(name: str) -> None:
    shape, dtype = em.INPUTS[name]
    traced = trace_model(getattr(em, name), shape, input_dtype=dtype, optimizer="adam")
    real = real_step(name, "adam")["saved"]
    assert real > 0
    assert abs(traced.saved_for_backward_bytes - real) <= 0.02 * real


def test_mlp_saved_bytes_by_hand() -> None:
    # x (32x100) saved by Linear1; ReLU output saved by ReLU and Linear2 (one storage);
    # Linear2 output saved by GELU; GELU output saved by Linear3. fp32.
    traced = trace_model(em.mlp, (32, 100), optimizer="sgd")
    assert traced.saved_for_backward_bytes == 4 * (32 * 100 + 32 * 256 + 32 * 256 + 32 * 256)


def test_tied_weights_counted_once() -> None:
    traced = trace_model(em.gpt, (4, 32), input_dtype="int64", optimizer="adam")
    model = em.gpt()
    assert traced.tied_parameters == 1
    assert traced.parameters == sum(p.numel() for p in model.parameters())
    untied = sum(p.numel() for p in model.parameters()) + model.head.weight.numel()
    assert traced.parameters < untied
    # Adam: exp_avg + exp_avg_sq per unique parameter, plus one 4-byte step tensor each
    n_tensors = len(list(model.parameters()))
    assert traced.optimizer_state_bytes == 2 * traced.parameter_bytes + 4 * n_tensors


def test_counter_changes_nothing_autograd_computes() -> None:
    torch.manual_seed(0)
    model = em.gpt()
    x = make_input("gpt")
    torch.manual_seed(1)  # the same dropout masks in both runs
    scalar_loss(model(x)).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with SavedTensorCounter(exclude=model.parameters()):
        loss = scalar_loss(model(x))
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))


def test_counter_creates_no_reference_cycle_when_graph_is_dropped() -> None:
    model = em.mlp()
    with SavedTensorCounter():
        hidden = torch.tanh(model[0](torch.randn(4, 100)))  # tanh saves its own output
        out = model[2](hidden)
    ref = weakref.ref(hidden)
    del out, hidden  # no backward: the graph is simply dropped
    gc.collect()
    assert ref() is None


def test_pure_bf16_trace_halves_the_state() -> None:
    fp32 = trace_model(em.mlp, (32, 100), optimizer="adam")
    bf16 = trace_model(em.mlp, (32, 100), optimizer="adam", precision="bf16")
    assert bf16.parameter_bytes * 2 == fp32.parameter_bytes
    assert bf16.saved_for_backward_bytes * 2 == fp32.saved_for_backward_bytes


def test_errors_are_trace_errors_naming_the_problem() -> None:
    with pytest.raises(TraceError, match="failed on the meta device on an input of shape \\(4, 32\\)"):
        trace_model(em.broken, (4, 32))
    with pytest.raises(TraceError, match="not a torch.nn.Module"):
        trace_model(lambda: 42, (4, 32))
    with pytest.raises(TraceError, match="factory failed"):
        trace_model(lambda: 1 / 0, (4, 32))
    with pytest.raises(TraceError, match="cannot be traced"):
        trace_model(em.mlp, (4, 100), precision="fp8")
    with pytest.raises(TraceError, match="backend 'cuda' is not valid"):
        trace_model(em.mlp, (4, 100), backend="cuda")
    with pytest.raises(TraceError, match="cannot import"):
        load_factory("no_such_module_xyz:f")
    with pytest.raises(TraceError, match="has no attribute"):
        load_factory("estimate_models:nope")
    with pytest.raises(TraceError, match="package.module:factory"):
        load_factory("estimate_models")
    with pytest.raises(TraceError, match="every dimension"):
        parse_shape("32,0")
    with pytest.raises(TraceError, match="integers separated"):
        parse_shape("32,abc")
    assert parse_shape("32, 100") == (32, 100)


def test_token_id_models_get_the_dtype_that_fixes_them_and_torchs_short_names_work() -> None:
    hint = r"Long, Int.*\(it takes integer inputs such as token ids: pass --input-dtype int64\)"
    with pytest.raises(TraceError, match=hint):
        trace_model(em.gpt, (4, 32), optimizer="adam")
    long = trace_model(em.gpt, (4, 32), input_dtype="long", optimizer="adam")
    assert long == trace_model(em.gpt, (4, 32), input_dtype="int64", optimizer="adam")
    with pytest.raises(TraceError) as raised:
        trace_model(em.broken, (4, 32))  # an error not about integer inputs gets no such hint
    assert "--input-dtype" not in str(raised.value)


def saved_in_real_step(model: torch.nn.Module, x: torch.Tensor, autocast: bool = False) -> int:
    counter = SavedTensorCounter(exclude=[*model.parameters(), *model.buffers()])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), counter:
        loss = scalar_loss(model(x))
    loss.backward()
    return counter.bytes


def test_fake_cpu_backend_follows_the_cpu_attention_kernel() -> None:
    real = saved_in_real_step(em.sdpa(), torch.randn(2, 64, 64))
    fake = trace_model(em.sdpa, (2, 64, 64), backend="fake-cpu").saved_for_backward_bytes
    meta = trace_model(em.sdpa, (2, 64, 64), backend="meta").saved_for_backward_bytes
    assert abs(fake - real) <= 0.02 * real
    assert meta > real  # meta falls back to the math kernel, which saves the seq² attention matrix


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_mixed_precision_trace_matches_a_real_autocast_step(name: str) -> None:
    shape, dtype = em.INPUTS[name]
    traced = trace_model(getattr(em, name), shape, input_dtype=dtype, optimizer="adam", precision="bf16-mixed")
    torch.manual_seed(0)
    real = saved_in_real_step(getattr(em, name)(), make_input(name), autocast=True)
    assert abs(traced.saved_for_backward_bytes - real) <= 0.02 * real
    fp32 = trace_model(getattr(em, name), shape, input_dtype=dtype, optimizer="adam")
    assert traced.parameter_bytes == fp32.parameter_bytes  # autocast keeps fp32 weights
