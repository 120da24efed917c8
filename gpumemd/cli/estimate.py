"""``gpumemd estimate``: training memory before running — from numbers, or traced from a real model.

    gpumemd estimate --params 7e9 --precision bf16-mixed --optimizer adamw [--grad-dtype fp32] [--explain]
    gpumemd estimate --params 7e9 --precision bf16-mixed --gpus 8 --zero 3 --layers 32 --hidden 4096 \\
        --heads 32 --seq 4096 --batch 1 --flash
    gpumemd estimate --model package.module:factory --input-shape 32,100 --optimizer adam [--json]

Torch is imported only for ``--model`` (the trace); the analytic path is pure arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any, TextIO

from gpumemd.analysis.estimate_explain import explain
from gpumemd.analysis.memory_estimate import OFFLOADS, Estimate, TransformerShape, dominant_term, estimate
from gpumemd.analysis.model_state import GRAD_DTYPES, OPTIMIZERS, PRECISIONS
from gpumemd.cli.errors import CliError
from gpumemd.probes.planning.trace import TraceResult, load_factory, parse_shape, trace_model
from gpumemd.report.fmt import fmt_bytes

_FSDP = {"no": 0, "grad-op": 2, "full": 3}
_SHAPE_ARGS = ("layers", "hidden", "heads", "seq", "batch")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "estimate",
        help="estimate training memory per GPU from numbers, or trace a real model on the meta device",
        description="Breakdown (weights, gradients, optimizer state, intermediates, activations) and "
        "peak per GPU, against common device sizes. Peak = weights + optimizer state + "
        "max(gradients + optimizer intermediates, activations).",
    )
    src = p.add_argument_group("what to estimate (one of)")
    src.add_argument("--params", type=str, default=None, help="parameter count, e.g. 7e9 or 125000000")
    src.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                     help="a factory returning an nn.Module; built on the meta device (no memory) and traced")
    p.add_argument("--input-shape", default=None, help="model input shape for --model, e.g. 32,100")
    p.add_argument("--input-dtype", default="float32", help="model input dtype (float32, int64 for token ids, ...)")
    p.add_argument("--trace-backend", default="meta", choices=("meta", "fake-cpu"),
                   help="meta (default) or fake-cpu: fake CPU tensors, so kernels choose as on CPU (SDPA "
                        "flash, autocast); mixed precision always uses fake-cpu")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="fp32, bf16-mixed/fp16-mixed (fp32 master weights), or pure bf16/fp16 (default fp32)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="default adamw")
    p.add_argument("--grad-dtype", default=None, choices=tuple(GRAD_DTYPES),
                   help="the gradients' dtype when it is not the precision's (default: fp32 under fp32, "
                        "else bf16/fp16), e.g. fp32 gradients with bf16 parameters (the analytic column; a traced "
                        "model keeps its own dtypes)")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPU count the state is sharded over")
    p.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="ZeRO stage (default 0)")
    p.add_argument("--fsdp", default=None, choices=tuple(_FSDP),
                   help="FSDP sharding: no (=ZeRO 0), grad-op (=2), full (=3)")
    p.add_argument("--offload", default="none", choices=OFFLOADS,
                   help="CPU offload: optimizer (ZeRO-Offload) or params (ZeRO-3/FSDP offload_params)")
    shape = p.add_argument_group("transformer shape (activations; all five of layers/hidden/heads/seq/batch)")
    shape.add_argument("--layers", type=int, default=None)
    shape.add_argument("--hidden", type=int, default=None)
    shape.add_argument("--heads", type=int, default=None)
    shape.add_argument("--seq", type=int, default=None, help="sequence length")
    shape.add_argument("--batch", type=int, default=None, help="micro-batch per GPU")
    shape.add_argument("--vocab", type=int, default=0,
                       help="vocabulary (adds logits; gives params if --params is absent)")
    shape.add_argument("--flash", action="store_true", help="flash attention (no seq² activations)")
    shape.add_argument("--checkpointing", action="store_true", help="full activation checkpointing per layer")
    p.add_argument("--json", action="store_true", help="print one JSON object (byte figures are integers)")
    p.add_argument("--explain", action="store_true",
                   help="after the table, say what each row is (bytes per parameter, what PyTorch keeps "
                        "there) and why the peak adds it where it does")
    p.set_defaults(func=run)


def _parse_params(text: str) -> int:
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise CliError(f"--params={text!r} is not valid: expected a parameter count such as 7e9") from None
    if not value.is_integer() or value < 1:
        raise CliError(f"--params={text!r} is not valid: expected a whole parameter count >= 1")
    return int(value)


def _shape(args: argparse.Namespace) -> TransformerShape | None:
    given = [name for name in _SHAPE_ARGS if getattr(args, name) is not None]
    if not given:
        if args.flash or args.checkpointing or args.vocab:
            raise CliError("--flash/--checkpointing/--vocab need a transformer shape: "
                           "--layers --hidden --heads --seq --batch")
        return None
    missing = [f"--{name}" for name in _SHAPE_ARGS if getattr(args, name) is None]
    if missing:
        raise CliError("a transformer shape needs all of --layers --hidden --heads --seq --batch; "
                       f"missing {' '.join(missing)}")
    return TransformerShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                            batch=args.batch, vocab=args.vocab, flash=args.flash,
                            checkpointing=args.checkpointing)


def _stage(args: argparse.Namespace) -> int:
    if args.zero is not None and args.fsdp is not None and args.zero != _FSDP[args.fsdp]:
        raise CliError(f"--zero {args.zero} and --fsdp {args.fsdp} disagree "
                       f"(fsdp {args.fsdp} is ZeRO stage {_FSDP[args.fsdp]})")
    return _FSDP[args.fsdp] if args.fsdp is not None else args.zero or 0


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from_shape = args.params is None and args.model is None and bool(args.vocab) and args.layers is not None
    if (args.params is None) == (args.model is None) and not from_shape:
        raise CliError("give exactly one of --params N or --model MODULE:FACTORY "
                       "(or a transformer shape with --vocab, whose parameter count is computed)")
    if args.gpus < 1:
        raise CliError(f"--gpus={args.gpus} is not valid: expected an integer >= 1")
    shape = _shape(args)
    stage = _stage(args)
    traced: TraceResult | None = None
    params: int | None
    if args.model is not None:
        if args.input_shape is None:
            raise CliError("--model needs --input-shape, e.g. --input-shape 32,100")
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # the console script does not see the working directory

        input_shape = parse_shape(args.input_shape)
        traced = trace_model(load_factory(args.model), input_shape, input_dtype=args.input_dtype,
                             optimizer=args.optimizer, precision=args.precision,
                             backend=args.trace_backend)
        params = traced.parameters
    else:
        params = _parse_params(args.params) if args.params is not None else None
    # a bad value found below (TransformerShape, trace_model's TraceError, estimate) is a ValueError, which
    # cli.main prints as one line with exit code 2
    est = estimate(params, precision=args.precision, optimizer=args.optimizer, gpus=args.gpus,
                   zero_stage=stage, offload=args.offload, shape=shape, grad_dtype=args.grad_dtype)
    if args.json:
        doc = to_json(est, traced)
        if args.explain:
            doc["explain"] = explain(est)
        print(json.dumps(doc, sort_keys=True), file=out)
    else:
        print(render(est, traced), file=out)
        if args.explain:
            print("\n" + "\n".join(explain(est)), file=out)
    return 0


def to_json(est: Estimate, traced: TraceResult | None = None) -> dict[str, Any]:
    """One JSON object; every byte figure an int."""
    doc: dict[str, Any] = {
        "mode": "model" if traced is not None else "params",
        "params": est.params,
        "precision": est.precision,
        "optimizer": est.optimizer,
        "grad_dtype": est.grad_dtype,  # null: the precision's
        "gpus": est.gpus,
        "zero_stage": est.zero_stage,
        "offload": est.offload,
        "per_gpu_bytes": est.terms(),
        "activations_known": est.activations_bytes is not None,
        "before_activations_bytes": est.before_activations_bytes,
        "peak_bytes": est.peak_bytes,
        "host_bytes": est.host_bytes,
        "dominant": est.dominant,
        "devices": [asdict(d) for d in est.devices],
        "formula": "weights + optimizer_state + max(gradients + optimizer_intermediates, activations)",
        "shape": asdict(est.shape) if est.shape is not None else None,
    }
    if traced is not None:
        doc["traced"] = {**asdict(traced), "peak_bytes": traced.peak_bytes,
                         "dominant": dominant_term(_traced_terms(traced))}
    return doc


def _traced_terms(traced: TraceResult) -> dict[str, int]:
    """The traced model's terms, by ``Estimate.terms()``'s names (in its order)."""
    return {
        "weights": traced.parameter_bytes + traced.buffer_bytes,
        "gradients": traced.gradient_bytes,
        "optimizer_state": traced.optimizer_state_bytes,
        "optimizer_intermediates": traced.optimizer_intermediates_bytes,
        "activations": traced.saved_for_backward_bytes,
    }


def render(est: Estimate, traced: TraceResult | None = None) -> str:
    """The human table: per-GPU terms (analytic, and traced with --model), peak, device fit."""
    lines = [
        f"{est.params:,} parameters, {est.precision}"
        + (f", {est.grad_dtype} gradients" if est.grad_dtype else "")
        + f", {est.optimizer}, {est.gpus} GPU(s), ZeRO stage {est.zero_stage}, offload {est.offload}"
    ]
    analytic_terms = {**est.terms(), "activations": est.activations_bytes}  # None when unknown: shown as "-"
    traced_terms = _traced_terms(traced) if traced else {}
    rows: list[tuple[str, int | None, int | None]] = [
        (name.replace("_", " "), analytic_terms[name], traced_terms.get(name))
        for name in ("weights", "gradients", "optimizer_state", "optimizer_intermediates", "activations")
    ]
    if est.gather_bytes:
        rows.append(("stage-3 gather buffer", est.gather_bytes, None))
    rows.append(("peak", est.peak_bytes, traced.peak_bytes if traced else None))
    header = f"{'term (per GPU)':<26}{'analytic':>14}" + (f"{'traced':>14}" if traced else "")
    lines += ["", header, "-" * len(header)]
    for name, analytic, exact in rows:
        if name == "peak":
            lines.append("-" * len(header))
        lines.append(f"{name:<26}{fmt_bytes(analytic):>14}" + (f"{fmt_bytes(exact):>14}" if traced else ""))
    subtotal = f"before activations (weights + gradients + optimizer state): {fmt_bytes(est.before_activations_bytes)}"
    if est.zero_stage == 0 and est.offload == "none" and est.params:  # per-param figures only when unsharded
        subtotal += f" per GPU, {est.before_activations_bytes / est.params:.1f} B/param"
        if est.before_activations_bytes >= 1e9:  # the decimal figure people quote ("16 B/param: 112 GB")
            subtotal += f" ({est.before_activations_bytes / 1e9:,.1f} GB)"
    else:
        subtotal += " per GPU (sharded / offloaded)"
    lines.append(subtotal)
    if est.activations_bytes is None:
        lines.append("(analytic activations unknown: give --layers --hidden --heads --seq --batch)")
    if est.host_bytes:
        lines.append(f"host memory (offloaded, per GPU process): {fmt_bytes(est.host_bytes)}")
    if traced and traced.tied_parameters:
        lines.append(f"tied parameters counted once: {traced.tied_parameters}")
    dominant = est.dominant if traced is None else dominant_term(traced_terms)
    lines.append(f"dominant term{' (traced)' if traced else ''}: {dominant.replace('_', ' ')}")
    if traced and est.gpus > 1:
        lines.append("(traced column: the whole model in one process, unsharded)")
    lines.append("peak = weights + optimizer state + max(gradients + optimizer intermediates, activations)")
    peak = traced.peak_bytes if traced else est.peak_bytes
    fits = ", ".join(f"{d.name} {'fits' if d.capacity_bytes >= peak else 'no'}" for d in est.devices)
    lines.append(f"devices ({'traced' if traced else 'analytic'} peak): {fits}")
    return "\n".join(lines)
