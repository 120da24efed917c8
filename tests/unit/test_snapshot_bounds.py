"""Snapshot pickles someone sent: each way a small file could make the loader use unbounded memory, time
or C stack is refused before anything is built, and real snapshots (protocols 2-5) still load.

The attack tests run the loader in a child process under a 512 MiB address-space limit and a timeout,
so a regression fails the test instead of exhausting the machine: before these bounds, each attack cost
GBs of memory, unbounded time, or a segfault (all of them were run against the old loader that way).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import subprocess
import sys
import time
import tracemalloc
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oom_snapshot_data import FRAMES, MiB, make_snapshot

from gpumemd.probes.snapshots.snapshot_load import loads_snapshot
from gpumemd.probes.snapshots.snapshot_rules import SnapshotLoadError

_CHILD_ADDRESS_SPACE = 512 * MiB
_CHILD_TIMEOUT_S = 20.0
_REFUSAL_PEAK = 16 * MiB  # what a refused attack may allocate (tracemalloc's peak) before it is refused

_CHILD = """
import json, resource, sys, time, tracemalloc
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from gpumemd.probes.snapshots.snapshot_load import load_snapshot, loads_snapshot
from gpumemd.probes.snapshots.snapshot_rules import SnapshotLoadError
data = sys.stdin.buffer.read()
tracemalloc.start()
start = time.perf_counter()
try:
    loads_snapshot(data) if sys.argv[1] == "-" else load_snapshot(sys.argv[1])
    result = {"outcome": "loaded", "message": ""}
except SnapshotLoadError as exc:
    result = {"outcome": "refused", "message": str(exc)}
except BaseException as exc:
    result = {"outcome": type(exc).__name__, "message": str(exc)[:300]}
result["seconds"] = time.perf_counter() - start
result["peak_bytes"] = tracemalloc.get_traced_memory()[1]
print(json.dumps(result))
"""


def _load_in_child(data: bytes = b"", path: str = "-") -> dict[str, Any]:
    """loads_snapshot(data), or load_snapshot(path), in a child with bounded memory and time."""
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, path, str(_CHILD_ADDRESS_SPACE)], input=data,
                              capture_output=True, timeout=_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"outcome": f"still running after {_CHILD_TIMEOUT_S} s", "message": ""}
    if proc.returncode != 0:
        return {"outcome": f"died with exit status {proc.returncode}", "message": proc.stderr[-500:].decode()}
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _assert_refused(result: dict[str, Any], pattern: str) -> None:
    assert result["outcome"] == "refused", result
    assert re.search(pattern, result["message"]), result
    assert "\n" not in result["message"]
    assert result["peak_bytes"] < _REFUSAL_PEAK, result


# --- the attacks, as bytes -------------------------------------------------------------------------


def _memo_index_file() -> bytes:
    # PROTO 4, NONE, LONG_BINPUT 2**26, STOP: the C unpickler sizes its memo table by the index (1 GiB)
    return b"\x80\x04N" + b"r" + struct.pack("<I", 2**26) + b"."


def _bytearray_of(n: int) -> bytes:
    # {"segments": [bytearray(n)]}: REDUCE of an allowlisted constructor on a 4-byte int
    return (b"\x80\x04}\x8c\x08segments]" + b"\x8c\x08builtins\x8c\x09bytearray\x93" + b"J" + struct.pack("<i", n)
            + b"\x85Ras.")


def _multiplying_lists(levels: int, fanout: int) -> bytes:
    # pickle's own output for x = [x] * fanout, levels times: each level is `fanout` memo references
    x: list[Any] = []
    for _ in range(levels):
        x = [x] * fanout
    return pickle.dumps({"segments": x})


def _quadratic_snapshot(n: int) -> bytes:
    # n references to one segment holding n references to one block: summarize_snapshot walks n*n blocks
    block = {"size": 512, "state": "active_allocated", "frames": list(FRAMES)}
    segment = {"device": 0, "total_size": 512 * n, "blocks": [block] * n}
    return pickle.dumps({"segments": [segment] * n, "device_traces": []})


def _nested_lists(depth: int) -> bytes:
    # depth EMPTY_LISTs, then depth - 1 APPENDs: [[[...]]] (pickle.dumps itself recurses too deep for it)
    return b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."


def _nested_tuple_key(depth: int) -> bytes:
    # {((((),),),): None}: hashing the key recurses `depth` deep in C (CPython 3.11 has no guard there)
    return b"\x80\x04}" + b")" + b"\x85" * depth + b"Ns."


def _doubling_tuple_key(levels: int) -> bytes:
    # t = (t, t) via memo references, `levels` times, then {t: None}: hashing walks 2**levels tuples
    out = b"\x80\x04})\x94"
    for k in range(1, levels + 1):
        out += (b"0" if k == 1 else b"") + b"h" + bytes([k - 1]) + b"h" + bytes([k - 1]) + b"\x86\x94" + b"0"
    return out + b"h" + bytes([levels]) + b"Ns."


def _repeated_set_copies(distinct: int, copies: int) -> bytes:
    # L = [0..distinct); then `copies` times set(L) (two memo references, TUPLE1, REDUCE) and POP
    out = b"\x80\x04}\x8c\x08segments]" + b"\x8c\x08builtins\x8c\x03set\x93\x940"
    out += b"](" + b"".join(b"J" + struct.pack("<i", i) for i in range(distinct)) + b"e\x940"
    out += b"h\x00h\x01\x85R0" * copies
    return out + b"s."


def _colliding_int_keys(n: int) -> bytes:
    # n dict keys 5 + k * (2**61 - 1): all hash to 5, so each insert compares with every earlier key
    keys = (5 + k * (2**61 - 1) for k in range(1, n + 1))
    items = b"".join(b"\x8a\x0c" + key.to_bytes(12, "little", signed=True) + b"N" for key in keys)
    return b"\x80\x04}(" + items + b"u."


# --- each attack, refused ---------------------------------------------------------------------------


def test_a_9_byte_file_with_a_huge_memo_index_is_refused_before_the_memo_table_grows() -> None:
    data = _memo_index_file()
    assert len(data) == 9
    _assert_refused(_load_in_child(data), r"refused memo index 67108864 at byte 3: the next one in order is 0")


def test_bytearray_of_a_huge_int_is_refused() -> None:
    _assert_refused(_load_in_child(_bytearray_of(2**30)), r"refused bytearray\(int\)")


@pytest.mark.parametrize(("data", "what"), [
    (_multiplying_lists(levels=30, fanout=8), "8**30 objects in 200 bytes"),
    (_quadratic_snapshot(4000), "16M blocks for summarize_snapshot in 30 KB"),
])
def test_shared_references_that_multiply_are_refused(data: bytes, what: str) -> None:
    _assert_refused(_load_in_child(data), r"refused a snapshot of more than 1048576 objects as a walker counts them")


def test_a_file_over_the_size_cap_is_refused_unread(tmp_path: Any) -> None:
    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        f.truncate(2 * 2**30 + 1)  # sparse: no disk, and nothing to read unless the loader reads it
    result = _load_in_child(path=str(path))
    _assert_refused(result, rf"refused {re.escape(str(path))}: 2147483649 bytes, over the 2147483648-byte limit")


def test_a_fifo_is_refused_not_waited_on(tmp_path: Any) -> None:
    path = tmp_path / "snapshot.pickle"
    os.mkfifo(path)
    _assert_refused(_load_in_child(path=str(path)), "is not a regular file")


def test_deep_nesting_is_refused() -> None:
    _assert_refused(_load_in_child(_nested_lists(100_000)), r"refused containers nested more than 100 deep")
    # before the bounds: a segfault (the tuple is hashed as a dict key, recursing in C)
    _assert_refused(_load_in_child(_nested_tuple_key(10**6)), r"refused containers nested more than 100 deep")


def test_a_recursion_error_while_loading_is_a_snapshot_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumemd.probes.snapshots import snapshot_load

    def recurse(*args: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(snapshot_load, "prescan", recurse)
    with pytest.raises(SnapshotLoadError, match="nested too deeply"):
        loads_snapshot(pickle.dumps({"segments": []}))


def test_hashing_that_multiplies_or_collides_is_refused() -> None:
    # 570 bytes that hash 2**80 tuples (before the bounds: never finished)
    _assert_refused(_load_in_child(_doubling_tuple_key(80)), r"more than 1048576 objects")
    # 90 KB of keys that all collide: 18M comparisons (a 3 MB file: 2e10)
    _assert_refused(_load_in_child(_colliding_int_keys(6000)),
                    r"hashing its dict keys and set members would walk more than 4096")


def test_repeated_copies_through_a_constructor_are_refused() -> None:
    # 3000 ints copied 1000 times from 20 KB; the POPs keep every copy out of the tree
    _assert_refused(_load_in_child(_repeated_set_copies(3000, 1000)),
                    r"set\(\), frozenset\(\) and bytearray\(\) would copy more than 4 elements per byte")


@pytest.mark.parametrize(("data", "pattern"), [
    (b"\x80\x02\x82\x01.", "opcode EXT1 at byte 2"),
    (b"\x80\x02NQ.", "opcode BINPERSID at byte 3"),
    (b"\x80\x02cbuiltins\nset\n)\x81.", "opcode NEWOBJ at byte 17"),
    (b"\x80\x02(ibuiltins\nset\n.", "opcode INST at byte 3"),
    (b"\x80\x02}N\x62.", "opcode BUILD at byte 4"),
    (b"\x80\x02\x8b\x01\x00\x00\x00\x01.", "opcode LONG4 at byte 2"),
    (b"I42\n.", "opcode INT at byte 0"),
    (b"\x80\x05\x97.", "opcode NEXT_BUFFER at byte 2"),
    (b"\x80\x02\xff.", r"byte 0xff \(not a pickle opcode\) at byte 2"),
    (b"\x80\x02cos\nsystem\n.", r"refused to load os\.system"),
    (b"\x80\x04\x8d" + struct.pack("<Q", 2**62) + b"x.", "the 4611686018427387904-byte argument at byte 2 is longer"),
    (b"\x80\x04h\x05.", "refused memo index 5 at byte 2: only 0 objects"),
    (b"\x80\x04]\x94]\x94a\x94h\x01Na.", "a container is added to after it was placed in another"),
    (b"\x80\x04]\x94h\x00a.", r"a container placed in itself \(a reference cycle\)"),
    (b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x04\x00\x00\x00zlib\x86R.", r"refused _codecs\.encode"),
    (b"\x80\x02ccollections\nOrderedDict\n](K\x01K\x02\x86e\x85R.", r"refused OrderedDict\(\) with arguments"),
    (b"\x80\x04\x8c\x08segments", "ends before its STOP opcode"),
])
def test_what_a_snapshot_never_holds_is_refused_by_name(data: bytes, pattern: str) -> None:
    with pytest.raises(SnapshotLoadError, match=pattern):
        loads_snapshot(data)


def test_the_limits_are_parameters_and_each_one_binds(tmp_path: Any) -> None:
    from gpumemd.probes.snapshots.snapshot_load import load_snapshot as _load_snapshot
    from gpumemd.probes.snapshots.snapshot_load import loads_snapshot as _loads_snapshot
    from gpumemd.probes.snapshots.snapshot_rules import Limits as _Limits

    data = pickle.dumps(make_snapshot(history=6))
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(data)
    assert _load_snapshot(str(path), _Limits(max_bytes=len(data)))["segments"]
    with pytest.raises(SnapshotLoadError, match=rf"{len(data)} bytes, over the {len(data) - 1}-byte limit"):
        _load_snapshot(str(path), _Limits(max_bytes=len(data) - 1))
    with pytest.raises(SnapshotLoadError, match="more than 100 objects"):
        _loads_snapshot(data, _Limits(tree_nodes_per_byte=0, min_tree_nodes=100))
    with pytest.raises(SnapshotLoadError, match="nested more than 3 deep"):
        _loads_snapshot(data, _Limits(max_depth=3))
    with pytest.raises(SnapshotLoadError, match="would copy more than"):
        _loads_snapshot(pickle.dumps({"segments": [], "s": set(range(20))}, protocol=2),
                        _Limits(copy_elements_per_byte=0, min_copy_elements=10))
    with pytest.raises(SnapshotLoadError, match="walk more than 2 tuple"):  # a dict key, seen by the prescan
        _loads_snapshot(pickle.dumps({"segments": [], "k": {(1, 2): 0}}), _Limits(max_hashed_nodes=2))
    with pytest.raises(SnapshotLoadError, match=r"set\(\): hashing its members"):  # set([...]): only at runtime
        _loads_snapshot(pickle.dumps({"segments": [], "s": {(1, 2)}}, protocol=2), _Limits(max_hashed_nodes=2))


# --- real snapshots still load ----------------------------------------------------------------------

_RESAVED = {
    "set": {1, 2}, "frozenset": frozenset({"a"}), "empty": (set(), frozenset(), OrderedDict(), b"", bytearray()),
    "ordered": OrderedDict(b=1, a=[2]), "complex": 1 + 2j, "bytearray": bytearray(b"\x00\xff"), "bytes": b"ab\xff",
    "odd_keys": {(1, "a"): 1.5, 2.5: None, frozenset({1}): 2j, 3j: b"k", b"k": 1}, "big": 2**100,
}


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_real_snapshots_and_resaved_containers_load_at_every_protocol(protocol: int) -> None:
    snap = make_snapshot(history=30)
    assert loads_snapshot(pickle.dumps(snap, protocol=protocol)) == snap
    assert loads_snapshot(pickle.dumps(snap["segments"], protocol=protocol)) == snap["segments"]
    resaved = OrderedDict(segments=snap["segments"], **_RESAVED)
    loaded = loads_snapshot(pickle.dumps(resaved, protocol=protocol))
    assert loaded == resaved and type(loaded) is OrderedDict
    assert {k: type(v) for k, v in loaded.items()} == {k: type(v) for k, v in resaved.items()}


def test_a_snapshot_sharing_frames_as_torch_does_stays_far_below_the_budget() -> None:
    # torch shares every frame dict between tracebacks, and one traceback list between a block's alloc,
    # free_requested and free_completed events and the block itself (_snapshot, py_symbolize)
    from gpumemd.probes.snapshots.snapshot_prescan import prescan as _prescan
    from gpumemd.probes.snapshots.snapshot_rules import DEFAULT_LIMITS as _DEFAULT_LIMITS

    frames = [{"filename": f"/job/f{i}.py", "line": i, "name": f"fn{i}"} for i in range(60)]
    tracebacks = [frames[i % 20:i % 20 + 40] for i in range(500)]
    blocks = [{"address": i, "size": 512, "state": "active_allocated", "frames": tracebacks[i]} for i in range(500)]
    trace = [{"action": action, "addr": i, "size": 512, "frames": tracebacks[i]}
             for i in range(500) for action in ("alloc", "free_requested", "free_completed")]
    data = pickle.dumps({"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]})
    nodes_per_byte = _prescan(data, _DEFAULT_LIMITS) / len(data)
    assert 3 < nodes_per_byte < _DEFAULT_LIMITS.tree_nodes_per_byte / 4


@st.composite
def _shared_structures(draw: st.DrawFn) -> Any:
    """Lists, dicts and tuples built from earlier ones, so that some are shared (memo references)."""
    pool: list[Any] = [draw(st.integers(-(2**70), 2**70)), draw(st.text(max_size=3)), None, 1.5]
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["list", "dict", "tuple"]))
        items = draw(st.lists(st.sampled_from(pool), max_size=4))
        pool.append(list(items) if kind == "list" else tuple(items) if kind == "tuple"
                    else {f"k{i}": item for i, item in enumerate(items)})
    return [pool[-1], pool[len(pool) // 2]]


def _objects_as_a_walker_counts_them(root: Any) -> int:
    count, pending = 0, [root]
    while pending:
        node = pending.pop()
        count += 1
        if isinstance(node, dict):
            pending.extend([*node.keys(), *node.values()])
        elif isinstance(node, (list, tuple)):
            pending.extend(node)
    return count


@settings(max_examples=150, deadline=None)
@given(_shared_structures(), st.sampled_from([2, 3, 4, 5]))
def test_the_prescan_counts_what_pickle_builds_exactly(obj: Any, protocol: int) -> None:
    from gpumemd.probes.snapshots.snapshot_prescan import prescan as _prescan
    from gpumemd.probes.snapshots.snapshot_rules import DEFAULT_LIMITS as _DEFAULT_LIMITS

    data = pickle.dumps(obj, protocol=protocol)
    assert _prescan(data, _DEFAULT_LIMITS) == _objects_as_a_walker_counts_them(obj)
    assert loads_snapshot(data) == obj


# --- any input: a snapshot or SnapshotLoadError, in bounded memory and time --------------------------

_PEAK_BOUND = 64 * MiB  # tracemalloc's peak for one input of at most a few KB
_TIME_BOUND_S = 2.0  # generous: a few KB load in milliseconds; the old loader hung, or took 57 s


def _loads_bounded(data: bytes) -> None:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        assert isinstance(loads_snapshot(data), (dict, list))
    except SnapshotLoadError:
        pass
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < _PEAK_BOUND, f"{peak} bytes for a {len(data)}-byte input"
    assert elapsed < _TIME_BOUND_S, f"{elapsed:.1f} s for a {len(data)}-byte input"


_BASES = [pickle.dumps(make_snapshot(history=3), protocol=p) for p in (2, 3, 4, 5)]
_MUTATIONS = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, 2**16),
                                st.binary(min_size=1, max_size=9)), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.sampled_from([b"", b"\x80\x02", b"\x80\x04", b"\x80\x05"]))
def test_arbitrary_bytes_load_or_are_refused_within_bounds(data: bytes, prefix: bytes) -> None:
    _loads_bounded(prefix + data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_BASES), _MUTATIONS)
def test_mutated_real_snapshots_load_or_are_refused_within_bounds(base: bytes,
                                                                  mutations: list[tuple[str, int, bytes]]) -> None:
    data = bytearray(base)
    for kind, where, payload in mutations:
        at = where % (len(data) + 1)
        if kind == "flip":
            data[at:at + len(payload)] = payload
        elif kind == "insert":
            data[at:at] = payload
        else:
            del data[at:at + len(payload)]
    _loads_bounded(bytes(data))
