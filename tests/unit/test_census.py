"""The census probe on real CPU models and optimizers: exact bytes, names, dedup, special tensors."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from gpumemd.probes.census.census_steps import take_census
from gpumemd.records.census import CATEGORIES, Census
from gpumemd.records.device import Device
from gpumemd.records.samples import AllocatorSample


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _named_bytes(census: Census, names: set[str]) -> int:
    return sum(g.nbytes for g in census.groups if g.key.name in names)


def _train(model: nn.Module, opt: torch.optim.Optimizer, make_input: Any, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        model(make_input()).float().pow(2).mean().backward()
        opt.step()


@pytest.fixture
def clean_heap() -> None:
    gc.collect()  # graph cycles left by earlier tests must not show up as this test's graph bytes


def test_mlp_with_sgd_momentum_counts_parameters_gradients_and_momentum_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 31), nn.ReLU(), nn.Linear(31, 7))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    _train(model, opt, lambda: torch.randn(5, 13))

    census = take_census(models=[model], optimizers=[opt], holders=0)

    params = dict(model.named_parameters())
    for fqn, p in params.items():
        [group] = census.groups_named(fqn)
        assert (group.key.category, group.count, group.nbytes) == ("parameter", 1, _nbytes(p))
        assert group.key.shape == tuple(p.shape) and group.key.dtype == "float32"
        [grad] = census.groups_named(f"{fqn}.grad")
        assert (grad.key.category, grad.nbytes) == ("gradient", _nbytes(p))
        [momentum] = census.groups_named(f"SGD[{fqn}].momentum_buffer")
        assert (momentum.key.category, momentum.nbytes) == ("optimizer_state", _nbytes(p))
    param_bytes = sum(_nbytes(p) for p in params.values())
    assert _named_bytes(census, set(params)) == param_bytes
    assert sum(g.nbytes for g in census.groups if g.key.category == "parameter") >= param_bytes


def test_conv_net_with_adam_counts_state_as_two_x_parameters_plus_step_counters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, lambda: torch.randn(2, 3, 8, 8))

    census = take_census(models=[model], optimizers=[opt], holders=0)

    params = dict(model.named_parameters())
    param_bytes = sum(_nbytes(p) for p in params.values())
    state_names = {f"Adam[{fqn}].{k}" for fqn in params for k in ("exp_avg", "exp_avg_sq", "step")}
    step_counter_bytes = sum(_nbytes(opt.state[p]["step"]) for p in params.values())
    assert step_counter_bytes == 4 * len(params)  # one float32 0-d tensor per parameter
    assert _named_bytes(census, state_names) == 2 * param_bytes + step_counter_bytes
    assert all(g.key.category == "optimizer_state" for g in census.groups if g.key.name in state_names)
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for fqn, b in buffers.items():
        [group] = census.groups_named(fqn)
        assert (group.key.category, group.nbytes) == ("buffer", _nbytes(b))


def test_small_transformer_with_adamw_counts_exactly() -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True, dropout=0.0),
        num_layers=2,
        enable_nested_tensor=False,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, lambda: torch.randn(3, 5, 16))

    census = take_census(models=[model], optimizers=[opt], holders=0)

    params = dict(model.named_parameters())
    assert "layers.1.self_attn.in_proj_weight" in params
    param_bytes = sum(_nbytes(p) for p in params.values())
    assert _named_bytes(census, set(params)) == param_bytes
    assert _named_bytes(census, {f"{f}.grad" for f in params}) == param_bytes
    moments = {f"AdamW[{f}].{k}" for f in params for k in ("exp_avg", "exp_avg_sq")}
    assert _named_bytes(census, moments) == 2 * param_bytes


def test_parameters_are_named_from_the_root_module_found_in_the_scan() -> None:
    model = nn.Sequential(nn.Linear(3, 19), nn.Linear(19, 2))

    census = take_census(holders=0)  # nothing registered: names come from the scan

    names = {g.key.name for g in census.groups if g.key.category == "parameter"}
    assert {"Sequential.0.weight", "Sequential.1.bias"} <= names or {"0.weight", "1.bias"} <= names
    del model


def test_a_compiled_model_is_named_as_the_model_names_its_parameters() -> None:
    # torch.compile wraps the model as the child `_orig_mod` of an OptimizedModule (lazily: nothing is
    # compiled until it is called). Names read "_orig_mod.0.weight", AdamW[_orig_mod.0.weight]... before.
    model = nn.Sequential(nn.Linear(3, 17), nn.Linear(17, 2))
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(compiled.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()

    registered = take_census(models=[compiled], optimizers=[opt], holders=0)
    scanned = take_census(holders=0)  # nothing registered: the OptimizedModule is the root found

    for census in (registered, scanned):
        names = {g.key.name for g in census.groups if g.key.category in ("parameter", "gradient", "optimizer_state")}
        assert {"0.weight", "0.weight.grad", "AdamW[1.bias].exp_avg"} <= names, names
        assert not any("_orig_mod" in name for name in names if name), names
    del compiled, model, opt


def test_views_share_their_base_storage_and_are_counted_once() -> None:
    base = torch.zeros(1237, dtype=torch.float64)
    views = [base[i : i + 5] for i in range(100)] + [base.view(1237, 1)]

    census = take_census(holders=0)

    groups = [g for g in census.groups if g.key.dtype == "float64" and g.key.shape in {(1237,), (5,), (1237, 1)}]
    assert [(g.key.shape, g.count, g.nbytes) for g in groups] == [((1237,), 1, 1237 * 8)]
    del views


def test_a_view_whose_base_is_gone_still_counts_the_whole_storage() -> None:
    view = torch.zeros(997, dtype=torch.float64)[:3]

    census = take_census(holders=0)

    [group] = [g for g in census.groups if g.key.dtype == "float64" and g.key.shape in {(3,), (997,)}]
    assert (group.count, group.nbytes) == (1, 997 * 8)
    del view


def test_meta_and_fake_tensors_have_no_memory_and_are_excluded() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = torch.empty(311, 7, device="meta")
    with FakeTensorMode():
        fake = torch.empty(313, 7)

    census = take_census(holders=0)

    assert not [g for g in census.groups if g.key.shape in {(311, 7), (313, 7)}]
    assert census.errors == 0
    del meta, fake


def test_sparse_coo_and_csr_count_their_component_storages() -> None:
    coo = torch.zeros(37, 41).index_put_((torch.arange(10), torch.arange(10) * 3), torch.ones(10)).to_sparse()
    csr = torch.zeros(43, 47).index_fill_(1, torch.tensor([2, 5]), 1.0).to_sparse_csr()

    census = take_census(holders=0)

    [coo_group] = [g for g in census.groups if g.key.shape == (37, 41)]
    assert coo_group.nbytes == 10 * 2 * 8 + 10 * 4  # int64 indices (2 x nnz) + float32 values
    [csr_group] = [g for g in census.groups if g.key.shape == (43, 47)]
    parts = (csr.crow_indices(), csr.col_indices(), csr.values())
    # The conversion over-allocates col_indices' storage: the storage is what memory holds.
    assert csr_group.nbytes == sum(p.untyped_storage().nbytes() for p in parts)
    nnz = 43 * 2
    assert csr_group.nbytes >= (43 + 1) * 8 + nnz * 8 + nnz * 4  # crow + col + values
    del parts
    del coo, csr


def test_nested_and_quantized_tensors_are_counted() -> None:
    parts = [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)]
    nested = torch.nested.nested_tensor(parts)
    del parts
    quantized = torch.quantize_per_tensor(torch.zeros(1009), 0.1, 0, torch.qint8)

    census = take_census(holders=0)

    assert [g.nbytes for g in census.groups if g.key.dtype == "qint8" and g.key.shape == (1009,)] == [1009]
    nested_bytes = nested.untyped_storage().nbytes()
    assert nested_bytes >= 18 * 8
    assert any(g.key.dtype == "float64" and g.nbytes == nested_bytes for g in census.groups)
    assert census.errors == 0
    del nested, quantized


def test_weak_proxies_and_dead_weakrefs_never_break_the_scan() -> None:
    class Holder:
        pass

    alive = torch.zeros(1013)
    gone = torch.zeros(1019)
    refs: list[Any] = [weakref.ref(gone), weakref.ref(alive)]
    dead_target = Holder()
    refs.append(weakref.proxy(dead_target))
    refs.append(weakref.proxy(Holder()))  # dead at once
    del dead_target, gone

    census = take_census(holders=0)

    assert census.errors == 0
    assert [g.nbytes for g in census.groups if g.key.shape == (1013,)] == [1013 * 4]
    assert not [g for g in census.groups if g.key.shape == (1019,)]
    del refs


def test_the_census_never_reads_values_or_copies(monkeypatch: pytest.MonkeyPatch, clean_heap: None) -> None:
    """.item(), .cpu(), repr() and .tolist() synchronise or allocate: the census must never call them."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the census read tensor values")

    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, lambda: torch.randn(3, 4))
    kept = [model(torch.randn(3, 4)).sum()]  # a live graph, walked too
    for name in ("item", "cpu", "tolist", "__repr__", "numpy", "to", "clone", "contiguous"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)

    census = take_census(models=[model], optimizers=[opt], holders=0)

    assert census.errors == 0
    assert census.bytes_by_category()["graph"] > 0
    del kept


def test_a_graph_kept_alive_is_estimated_within_five_percent_of_what_autograd_saved(clean_heap: None) -> None:
    """Truth: every tensor autograd saves, seen by saved_tensors_hooks, minus the storages that
    are counted anyway (parameters and the input). The same forward is then kept alive."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    x = torch.randn(16, 32)
    counted = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        probe = model(x).pow(2).mean()
    del probe
    gc.collect()  # tensors saved through a hook form cycles with their nodes
    truth = sum(n for ptr, n in saved.items() if ptr not in counted)
    before = take_census(models=[model], holders=0).bytes_by_category()["graph"]

    kept = [model(x).pow(2).mean()]
    census = take_census(models=[model], holders=0)

    estimate = census.bytes_by_category()["graph"] - before
    assert truth > 0
    assert abs(estimate - truth) <= 0.05 * truth, (estimate, truth)
    assert census.graph_retained_bytes > 0  # the dropout mask and the ReLU output are not gc-visible
    assert not census.graph_truncated
    del kept


def test_running_total_of_losses_is_a_graph_tensor_keeping_every_step_alive(clean_heap: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 1))
    total = torch.zeros(())

    def step() -> torch.Tensor:
        return model(torch.randn(32, 8)).pow(2).mean()

    base = take_census(models=[model], holders=0).bytes_by_category()["graph"]
    total = total + step()
    one = take_census(models=[model], holders=0)
    for _ in range(4):
        total = total + step()
    five = take_census(models=[model], holders=2, previous=one)

    graph_one = one.bytes_by_category()["graph"] - base
    graph_five = five.bytes_by_category()["graph"] - base
    assert graph_one > 32 * 128 * 4  # at least one step's hidden activations
    assert 4.5 * graph_one <= graph_five <= 5.5 * graph_one
    # The saved ReLU outputs keep their Python wrappers (PyObject preservation): visible, as "graph"
    # tensors with no gc referrer; the holder names the tensor whose graph keeps them.
    [hidden] = [g for g in five.groups if g.key.shape == (32, 128)]
    assert (hidden.key.category, hidden.count) == ("graph", 5)
    assert hidden.holder is not None and hidden.holder.startswith("autograd graph of `total` in ")
    del total


def test_graph_walk_is_bounded_and_says_so() -> None:
    x = torch.zeros(3, requires_grad=True)
    y = x
    for _ in range(50):
        y = y * 1.5

    census = take_census(holders=0, graph_max_nodes=10)

    assert census.graph_truncated
    del y


def test_graph_false_skips_the_walk() -> None:
    x = torch.zeros(3, requires_grad=True)
    kept = [(x.exp() * 2).sum()]

    census = take_census(holders=0, graph=False)

    assert census.graph_retained_bytes == 0
    del kept


def test_invisible_bytes_are_allocated_minus_visible_per_cuda_device() -> None:
    samples = [AllocatorSample(device=Device.cuda(0), allocated_bytes=10 << 20), AllocatorSample(device=Device.cuda(1))]

    census = take_census(holders=0, allocator=samples)

    assert census.invisible_bytes_by_device == {Device.cuda(0): 10 << 20}  # no CUDA tensor here; device 1 unknown
    assert take_census(holders=0).invisible_bytes_by_device == {}  # CPU only: absent, not 0


def test_result_shape_all_six_categories_and_a_bounded_ranked_list() -> None:
    big = [torch.zeros(4093 + i) for i in range(60)]

    census = take_census(holders=0, largest=50, step=7)

    assert set(census.bytes_by_category()) == set(CATEGORIES)
    assert census.step == 7 and census.objects_scanned > 1000
    top = census.top(3)
    assert [e.nbytes for e in top] == sorted((e.nbytes for e in census.largest), reverse=True)[:3]
    assert len(census.largest) == 50
    assert top[0].nbytes >= (4093 + 59) * 4
    assert {"nbytes", "shape", "dtype", "device", "category", "name"} <= set(dir(top[0]))
    assert census.total_bytes == sum(census.bytes_by_category().values())
    del big


def test_diff_names_the_group_that_grew_with_its_deltas() -> None:
    keep: list[torch.Tensor] = [torch.zeros(7, 1021) for _ in range(2)]
    before = take_census(holders=0)
    keep += [torch.zeros(7, 1021) for _ in range(5)]
    after = take_census(holders=0)

    deltas = after.diff(before)

    grown = [d for d in deltas if d.key.shape == (7, 1021)]
    assert [(d.count_delta, d.bytes_delta, d.key.category) for d in grown] == [(5, 5 * 7 * 1021 * 4, "other")]
    assert deltas[0].bytes_delta >= grown[0].bytes_delta
    del keep


def test_gradients_of_raw_leaf_tensors_are_reached_through_the_leaves() -> None:
    weight = torch.zeros(29, 3, requires_grad=True)  # optimised by hand: no Module, no Optimizer
    (weight * 2).sum().backward()

    census = take_census(holders=0)

    groups = sorted((g.key.category, g.nbytes) for g in census.groups if g.key.shape == (29, 3))
    assert groups == [("gradient", 29 * 3 * 4), ("other", 29 * 3 * 4)]
    del weight


def test_lazy_modules_uninitialized_parameters_have_no_memory_yet() -> None:
    lazy = nn.LazyLinear(4)

    census = take_census(models=[lazy], holders=0)

    assert census.errors == 0
    assert not census.groups_named("weight")
    del lazy
