"""affinity/wire.py: openpi's msgpack array encoding, both ways, and hostile input."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openpi_client import msgpack_numpy

from affinity import wire
from affinity.wire import WireError


def test_round_trip_with_openpi_client() -> None:
    obs = {
        "state": np.arange(8, dtype=np.float64),
        "images": {"cam_high": np.arange(224 * 224 * 3, dtype=np.uint8).reshape(224, 224, 3)},
        "prompt": "pick up the cube",
        "flag": np.bool_(True),
        "scale": np.float32(0.5),
    }
    got = wire.decode(msgpack_numpy.packb(obs))
    np.testing.assert_array_equal(got["state"], obs["state"])
    assert got["state"].dtype == np.float64
    np.testing.assert_array_equal(got["images"]["cam_high"], obs["images"]["cam_high"])
    assert got["images"]["cam_high"].dtype == np.uint8
    assert got["prompt"] == "pick up the cube"
    assert got["flag"] == np.bool_(True) and got["scale"] == np.float32(0.5)
    # the decoded arrays are views of the message, not copies
    assert not got["images"]["cam_high"].flags.owndata

    reply = {"actions": np.linspace(0, 1, 70, dtype=np.float32).reshape(10, 7), "n": np.int64(3)}
    back = msgpack_numpy.unpackb(wire.encode(reply))
    np.testing.assert_array_equal(back["actions"], reply["actions"])
    assert back["n"] == 3


def test_non_contiguous_and_scalar_shapes_encode() -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4).T  # Fortran order view
    np.testing.assert_array_equal(wire.decode(wire.encode({"a": a}))["a"], a)
    z = np.zeros((0, 5), np.float32)
    assert wire.decode(wire.encode({"z": z}))["z"].shape == (0, 5)
    s = np.array(2.5, np.float64)
    assert wire.decode(wire.encode({"s": s}))["s"].shape == ()


def _array(dtype: object, shape: object, data: object) -> bytes:
    return bytes(
        msgpack.packb({b"__ndarray__": True, b"dtype": dtype, b"shape": shape, b"data": data})
    )


@pytest.mark.parametrize(
    ("message", "words"),
    [
        (_array("<f4", [2, 2], b"\0" * 15), "needs 16 bytes"),
        (_array("<f4", [2, -2], b"\0" * 16), "non-negative"),
        (_array("<f4", "2x2", b"\0" * 16), "list"),
        (_array("<f4", [2.0, 2], b"\0" * 16), "non-negative integers"),
        (_array("|O", [1], b"\0" * 8), "list of 1 strings"),  # string arrays carry str only
        (_array("|O", [2], ["a"]), "list of 2 strings"),
        (_array("|O", [1], [b"a"]), "only strings"),
        (_array("|O", [2**40, 2**40], ["a"]), "the limit"),
        (_array("<c8", [1], b"\0" * 8), "not numeric"),
        (_array("|V4", [1], b"\0" * 4), "not numeric"),
        (_array("S3", [1], b"abc"), "not numeric"),
        (_array("no such", [1], b"\0"), "unknown array dtype"),
        (_array(7, [1], b"\0"), "dtype"),
        (_array("<f4", [1], "text"), "bytes"),
        (_array("<f4", [1] * 40, b"\0" * 4), "32 dimensions"),
        (_array("<f8", [2**40, 2**40], b"\0" * 8), "the limit"),
        (msgpack.packb({b"__npgeneric__": True, b"dtype": "<f8", b"data": "x"}), "number"),
        (msgpack.packb({b"__npgeneric__": True, b"dtype": "|b1", b"data": 1}), "true or false"),
        (msgpack.packb({b"__npgeneric__": True, b"dtype": "|u1", b"data": 300}), "does not fit"),
    ],
)
def test_malformed_arrays_are_refused_with_a_reason(message: bytes, words: str) -> None:
    with pytest.raises(WireError, match=words):
        wire.decode(message)


def test_malformed_msgpack_is_a_wire_error() -> None:
    good = wire.encode({"a": np.zeros(4, np.float32)})
    for bad in [
        good[:-1],  # truncated
        good + b"\x00",  # trailing bytes
        b"\xc1",  # never used
        b"\x91" * 100_000 + b"\xc0",  # nesting past msgpack's stack
        b"\xdd" + struct.pack(">I", 2**32 - 1),  # an array declared past the message
        b"\xc6" + struct.pack(">I", 2**31) + b"x",  # a bin declared past the message
        msgpack.packb({1: 2}),  # integer map keys
        b"",
    ]:
        with pytest.raises(WireError):
            wire.decode(bad)


def test_declared_sizes_are_checked_before_anything_is_allocated() -> None:
    huge = _array("<f8", [2**20, 2**20], b"\0" * 8)  # 8 TiB declared, 8 bytes sent
    tracemalloc.start()
    try:
        for _ in range(10):
            with pytest.raises(WireError):
                wire.decode(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_a_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        wire.decode(data)


leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
arrays = st.builds(
    lambda dtype, shape, seed: (
        np.random.default_rng(seed).integers(0, 100, size=shape).astype(dtype)
    ),
    st.sampled_from(["<f4", "<f8", "|u1", "<i8", "|b1", "<f2", "<u2"]),
    st.lists(st.integers(0, 4), max_size=4).map(tuple),
    st.integers(0, 1000),
)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.one_of(leaf, arrays),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_what_is_encoded_decodes_to_the_same(value: object) -> None:
    def same(a: object, b: object) -> None:
        if isinstance(a, np.ndarray):
            assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        elif isinstance(a, dict):
            assert isinstance(b, dict) and a.keys() == b.keys()
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, list):
            assert isinstance(b, list) and len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same(x, y)
        else:
            assert a == b

    same(value, wire.decode(wire.encode(value)))


def test_string_arrays_round_trip() -> None:
    strings = np.empty((2, 1), dtype=object)
    strings[:] = [["pick up the cube"], ["é"]]
    back = wire.decode(wire.encode({"prompt": strings}))["prompt"]
    assert back.dtype == object and back.shape == (2, 1) and back.tolist() == strings.tolist()
    with pytest.raises(TypeError):
        wire.encode(np.array([1, "a"], dtype=object))  # only str travels as a string array
