"""The job's exceptions pass through ``oom_guard`` / ``oom_report`` unchanged, whatever they carry, and
the OOM message parser gives a result or None on any text."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumemd
from gpumemd.analysis.oom_message import classify_exception, parse_oom_message
from gpumemd.records.oom import OomMessage


class OutOfMemoryError(RuntimeError):
    """Looks like torch's by name and module, so the classifier takes it for an OOM class."""


OutOfMemoryError.__module__ = "torch.cuda"


class BrokenStr(OutOfMemoryError):
    def __str__(self) -> str:
        raise ValueError("__str__ is broken")


class PlainBrokenStr(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("__str__ is broken")


def _huge_cuda_message(digits: int) -> str:
    n = "9" * digits
    return (f"CUDA out of memory. Tried to allocate {n}.00 GiB. GPU 0 has a total capacity of {n}.00 GiB of "
            f"which {n}.00 MiB is free. {n}.00 GiB allowed; Of the allocated memory {n}.00 GiB is allocated by "
            f"PyTorch, and {n}.00 MiB is reserved by PyTorch but unallocated.")


def _huge_cpu_message(digits: int) -> str:
    return ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
            f"to allocate {'9' * digits} bytes. Error code 12 (Cannot allocate memory)")


EXCEPTIONS = [
    pytest.param(BrokenStr, id="oom class, __str__ raises"),
    pytest.param(PlainBrokenStr, id="RuntimeError, __str__ raises"),
    pytest.param(lambda: RuntimeError(_huge_cuda_message(400)), id="CUDA OOM text, 400-digit sizes"),
    pytest.param(lambda: RuntimeError(_huge_cuda_message(5000)), id="CUDA OOM text, 5000-digit sizes"),
    pytest.param(lambda: RuntimeError(_huge_cpu_message(5000)), id="CPU OOM text, 5000-digit size"),
    pytest.param(lambda: KeyError("custom"), id="unrelated"),
]


@pytest.mark.parametrize("make", EXCEPTIONS)
@pytest.mark.parametrize("suppress", [False, True])
def test_guard_never_replaces_the_exception(make, suppress: bool, out_dir: str) -> None:  # type: ignore[no-untyped-def]
    exc = make()
    with gpumemd.attached(output_dir=out_dir):
        try:
            with gpumemd.oom_guard(suppress=suppress):
                raise exc
        except BaseException as caught:  # the point: what comes out
            assert caught is exc
            assert type(caught) is type(exc)
        # oom_report on the same exception: a result or None, never an exception
        result = gpumemd.oom_report(exc)
        assert result is None or isinstance(result, str)


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_guard_passes_base_exceptions_through(exc_type: type[BaseException], out_dir: str) -> None:
    with gpumemd.attached(output_dir=out_dir), pytest.raises(exc_type), gpumemd.oom_guard(suppress=True):
        raise exc_type()


def test_classifier_on_broken_str_and_huge_numbers() -> None:
    assert classify_exception(PlainBrokenStr()) is None
    oom = classify_exception(BrokenStr())
    assert oom is not None and oom.format == "unparsed"
    huge = classify_exception(RuntimeError(_huge_cuda_message(5000)))
    assert huge is not None and huge.kind == "cuda" and huge.requested_bytes is None  # an OOM, numbers unknown
    assert classify_exception(RuntimeError(_huge_cpu_message(5000))) is None  # not a size we can read


def test_a_long_digit_run_is_not_quadratic() -> None:
    """Bound: 20k digits parse in well under a second (the unbounded pattern took 7.6 s)."""
    text = "9" * 20_000 + " GiB allowed; " + _huge_cuda_message(30)
    start = time.perf_counter()
    parse_oom_message(text)
    assert time.perf_counter() - start < 1.0


@settings(max_examples=300, deadline=None, derandomize=True)  # CI: a fixed set
@given(st.text(alphabet=st.sampled_from(list("0123456789. GiBMKTbytesCUDA outfmemory;()allowed:")), max_size=400)
       | st.text(max_size=200))
def test_parser_gives_a_result_or_none_on_any_text(text: str) -> None:
    for candidate in (text, "CUDA out of memory. Tried to allocate " + text, _huge_cuda_message(3) + text):
        parsed = parse_oom_message(candidate)
        assert parsed is None or isinstance(parsed, OomMessage)
        assert classify_exception(RuntimeError(candidate)) is None or isinstance(
            classify_exception(RuntimeError(candidate)), OomMessage)
