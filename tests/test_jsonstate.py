"""megashard.jsonstate: exact JSON round trips, save-time errors with key paths, no pickle."""
from __future__ import annotations

import argparse
import base64
import collections
import enum
import io
import json
import math
import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from megashard import jsonstate
from megashard.errors import CheckpointError, MegashardError, StateDictError
from megashard.jsonstate import TAG, UNHANDLED, Unrepresentable, decode, encode, parse_json


class Color(enum.Enum):
    RED = "red"
    GREEN = 2


class Perm(enum.IntFlag):
    R = 4
    W = 2
    X = 1


class Outer:
    class Inner(enum.Enum):
        A = 1


for _cls in (Color, Perm, Outer.Inner):
    jsonstate.register_enum(_cls)


# --------------------------------------------------------------------------- helpers


def same(a, b) -> bool:
    """Equality that also demands identical types, NaN == NaN and the sign of zero."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and not isinstance(a, np.generic):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if type(a) is complex:
        return same(a.real, b.real) and same(a.imag, b.imag)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) in (dict, collections.OrderedDict):
        ka, kb = list(a), list(b)
        return len(ka) == len(kb) and all(
            same(x, y) and same(a[x], b[y]) for x, y in zip(ka, kb)
        )
    if type(a) in (set, frozenset):
        if len(a) != len(b):
            return False
        bmap = {x: x for x in b}
        return all(x in bmap and same(x, bmap[x]) for x in a)
    if type(a) is argparse.Namespace:
        return same(vars(a), vars(b))
    if type(a) is np.ndarray:
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if type(a) is io.BytesIO:
        return a.getvalue() == b.getvalue() and a.tell() == b.tell()
    return a == b


def dumps(value, **kw) -> str:
    """encode, then strict JSON text (allow_nan=False fails on any NaN/Infinity literal)."""
    return json.dumps(encode(value, **kw), separators=(",", ":"), allow_nan=False)


def loads(text, **kw):
    """Plain json.loads, then decode."""
    return decode(json.loads(text), **kw)


def roundtrip(value, **kw):
    text = dumps(value, **{k: v for k, v in kw.items() if k in ("lossy", "hook")})
    # The text must be strict JSON: no NaN/Infinity literals.
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    return loads(text, **{k: v for k, v in kw.items() if k == "resolver"})


# --------------------------------------------------------------------------- strategies

NP_DTYPES = ["?", "i1", "<i2", ">i4", "<i8", "u1", "<u2", "<u4", "<u8", "<f2", "<f4", ">f8",
             "<f8", "<c8", "<c16", "<U3", "S4", "<M8[s]", "<m8[ms]"]

hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(list(Color) + list(Perm) + [Perm.R | Perm.W, Outer.Inner.A]),
)
hashables = st.one_of(hashable_scalars, st.tuples(hashable_scalars, hashable_scalars))

np_arrays = st.sampled_from(NP_DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
)
np_scalars = st.sampled_from(NP_DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), ()).map(lambda a: a[()])
)

leaves = st.one_of(
    hashable_scalars,
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0]),
    st.complex_numbers(allow_nan=True),
    st.binary(max_size=16).map(bytearray),
    st.builds(lambda b, p: _bio(b, p), st.binary(max_size=8), st.integers(0, 10)),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 3), torch.device("meta")]),
    np_scalars,
    np_arrays,
    st.text(),
)


def _bio(b: bytes, pos: int) -> io.BytesIO:
    bio = io.BytesIO(b)
    bio.seek(pos)
    return bio


ident = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)


def containers(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=6), st.just(TAG)), children, max_size=4),
        st.dictionaries(hashables, children, max_size=4),
        st.dictionaries(hashables, children, max_size=3).map(collections.OrderedDict),
        st.dictionaries(ident, children, max_size=4).map(lambda d: argparse.Namespace(**d)),
        st.sets(hashables, max_size=4),
        st.frozensets(hashables, max_size=4),
    )


values = st.recursive(leaves, containers, max_leaves=25)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_roundtrip_property(value):
    assert same(roundtrip(value), value)


# --------------------------------------------------------------------------- exact forms


def test_plain_json_stays_plain():
    v = {"iteration": 100, "lr": 1e-4, "name": "gpt", "flags": [True, False, None], "neg0": -0.0,
         "nested": {"a": [1, 2.5, "x"]}, "big": 2**63 - 1, "small": -(2**63)}
    assert encode(v) == v
    assert same(loads(json.dumps(v)), v)


def test_special_floats_and_negative_zero():
    v = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 5e-324, 1.7976931348623157e308]
    text = dumps(v)
    assert "NaN" not in text and "Infinity" not in text
    out = loads(text)
    assert same(out, v)
    assert math.copysign(1.0, out[3]) == -1.0 and math.copysign(1.0, out[4]) == 1.0


def test_arbitrary_size_ints():
    v = [2**63, -(2**63) - 1, 10**5000, -(7**3000), 2**63 - 1]
    text = dumps(v)
    assert '"hex"' in text
    assert same(loads(text), v)


def test_non_str_keys_keep_type_and_order():
    d = {3: "a", 1: "b", "x": 1, (1, 2): [0], None: 0, 1.5: 2, False: 3, b"k": 4, Color.RED: 5}
    out = roundtrip(d)
    assert same(out, d)
    assert list(out) == [3, 1, "x", (1, 2), None, 1.5, False, b"k", Color.RED]
    # Megatron/torch optimizer state dict: int keys
    opt = {"state": {0: {"step": 10, "exp_avg": [0.1]}, 7: {"step": 10}},
           "param_groups": [{"params": [0, 7], "betas": (0.9, 0.95), "lr": 3e-4}]}
    assert same(roundtrip(opt), opt)


@pytest.mark.parametrize("lookalike", [
    {TAG: "tuple", "items": [1, 2]},
    {TAG: "repr", "type": "x", "repr": "y"},
    {TAG: 1},
    {"a": {TAG: "bytes", "b64": "AAAA"}},
])
def test_dict_that_looks_like_a_tag_is_escaped(lookalike):
    assert same(roundtrip(lookalike), lookalike)


def test_sets_sorted_when_possible():
    assert encode({3, 1, 2}) == {TAG: "set", "items": [1, 2, 3]}
    mixed = frozenset({1, "a", None, (2, "b")})
    assert same(roundtrip(mixed), mixed)


def test_enum_forms():
    for v in [Color.RED, Color.GREEN, Perm.R, Perm.R | Perm.X, Outer.Inner.A]:
        assert same(roundtrip(v), v)
    e = encode(Color.GREEN)
    assert e == {TAG: "enum", "module": Color.__module__, "qualname": "Color", "name": "GREEN"}
    assert "value" in encode(Perm.R | Perm.W)


def test_torch_and_numpy_types():
    v = {"dt": torch.bfloat16, "size": torch.Size([4, 8]), "dev": torch.device("cuda:1"),
         "arr": np.arange(12, dtype=">f4").reshape(3, 4).T,  # non-contiguous, big-endian
         "s64": np.float64(0.1), "i64": np.int64(-5), "b": np.bool_(True), "f16": np.float16(1.5),
         "u8": np.uint8(255), "str": np.str_("héllo")}
    out = roundtrip(v)
    assert same(out, v)
    assert out["arr"].flags.writeable and out["arr"].flags.c_contiguous
    assert encode(torch.bfloat16) == {TAG: "torch.dtype", "name": "bfloat16"}


def test_bytes_forms():
    v = [b"\x00\xff", bytearray(b"abc"), _bio(b"hello", 2), b""]
    assert same(roundtrip(v), v)


# --------------------------------------------------------------------------- RNG states


def test_python_random_state_roundtrip():
    random.seed(1234)
    random.gauss(0, 1)  # makes the third element a cached float on some versions
    state = random.getstate()
    out = loads(dumps(state))
    assert same(out, state)
    expected = [random.random() for _ in range(5)] + [random.gauss(0, 1)]
    random.setstate(out)
    assert [random.random() for _ in range(5)] + [random.gauss(0, 1)] == expected


def test_numpy_legacy_state_roundtrip():
    np.random.seed(42)
    np.random.standard_normal()  # has_gauss = 1 with a cached value
    state = np.random.get_state()
    assert state[3] == 1
    out = loads(dumps(state))
    assert same(out, state)
    expected = np.random.standard_normal(7)
    np.random.set_state(out)
    np.testing.assert_array_equal(np.random.standard_normal(7), expected)


def test_numpy_generator_state_roundtrip():
    rng = np.random.default_rng(7)
    rng.random()
    state = rng.bit_generator.state  # dict with 128-bit ints
    out = loads(dumps(state))
    assert same(out, state)
    expected = rng.random(5)
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = out
    np.testing.assert_array_equal(rng2.random(5), expected)


def test_torch_rng_state_via_hook():
    """A tensor leaves the tree through the save hook and comes back through the resolver."""
    torch.manual_seed(3)
    store = {}

    def hook(path, v):
        if not isinstance(v, torch.Tensor):
            return UNHANDLED
        store[path] = v.clone()
        return {"key": path}

    state = {"rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
    text = dumps(state, hook=hook)
    assert list(store) == ["rng.torch"]
    assert json.loads(text)["rng"]["torch"] == {TAG: "ref", "ref": {"key": "rng.torch"}}
    expected = torch.rand(4)
    out = loads(text, resolver=lambda ref, path: store[ref["key"]])
    assert same(out["rng"]["python"], state["rng"]["python"])
    torch.set_rng_state(out["rng"]["torch"])
    assert torch.equal(torch.rand(4), expected)

    with pytest.raises(CheckpointError, match="'rng.torch'.*no resolver"):
        loads(text)
    with pytest.raises(StateDictError, match="'x'.*not plain JSON"):
        encode({"x": torch.zeros(1)}, hook=lambda p, t: object())
    # A tensor that no hook takes is refused, naming the path and where tensors belong.
    for kw in ({}, {"hook": lambda p, v: UNHANDLED}):
        with pytest.raises(StateDictError, match=r"'rng\.torch'.*torch\.Tensor.*tensors belong in \.tensors files"):
            encode(state, **kw)


class FakeShardedTensor:
    def __init__(self, key):
        self.key = key


def test_general_hook_and_resolver():
    """The checkpoint layer's protocol: hook sees every non-primitive first, UNHANDLED
    falls through, refs are embedded by reference and handed back with their path."""
    seen = []
    refs = []

    def hook(path, value):
        seen.append((path, type(value).__name__))
        if isinstance(value, FakeShardedTensor):
            ref = {"kind": "sharded", "key": value.key}
            refs.append(ref)
            return ref
        if isinstance(value, bytes) and len(value) > 4:
            return {"kind": "bytes", "n": len(value)}
        return UNHANDLED

    state = {"model": {"w": FakeShardedTensor("w")}, "small": b"ab", "big": b"abcdefgh",
             "t": (1, 2), "it": 7, "lst": [1.5, "x", None]}
    tree = encode(state, hook=hook)
    assert seen == [("model.w", "FakeShardedTensor"), ("small", "bytes"), ("big", "bytes"), ("t", "tuple")]
    refs[0]["file"] = "model.tensors"  # filled in after encoding, as the save path does
    text = json.dumps(tree)
    assert json.loads(text)["model"]["w"] == {TAG: "ref", "ref": {"kind": "sharded", "key": "w", "file": "model.tensors"}}

    got = []

    def resolver(ref, path):
        got.append((path, ref))
        return ("resolved", ref["kind"])

    out = loads(text, resolver=resolver)
    assert out["model"]["w"] == ("resolved", "sharded") and out["big"] == ("resolved", "bytes")
    assert out["small"] == b"ab" and out["t"] == (1, 2) and out["it"] == 7
    assert [p for p, _ in got] == ["model.w", "big"]

    with pytest.raises(StateDictError, match="'model.w'.*not plain JSON"):
        encode(state, hook=lambda p, v: {"x": object()} if isinstance(v, FakeShardedTensor) else UNHANDLED)
    with pytest.raises(StateDictError, match="'model.w'.*FakeShardedTensor"):
        encode(state, hook=lambda p, v: UNHANDLED)
    with pytest.raises(CheckpointError, match="'model.w'.*resolver"):
        loads(text)
    # A resolver's own megashard errors pass through unchanged.
    with pytest.raises(CheckpointError, match="^boom$"):
        loads(text, resolver=lambda ref, p: (_ for _ in ()).throw(CheckpointError("boom")))


# --------------------------------------------------------------------------- Namespace


def test_real_megatron_style_namespace():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--data-path", nargs="*", default=["a", "b"])
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(["--bf16", "--lr", "1e-3"])
    args.params_dtype = torch.bfloat16
    args.color = Color.RED
    args.iteration_shape = (2, 3)
    args.rank_map = {0: "a", 1: "b"}
    out = roundtrip(args)
    assert type(out) is argparse.Namespace
    assert same(out, args)
    assert out.params_dtype is torch.bfloat16 and out.color is Color.RED


def test_namespace_lossy_placeholders():
    args = argparse.Namespace(lr=1.0, init_method=lambda x: x, model=object(), dt=torch.float16)
    with pytest.raises(StateDictError) as ei:
        encode(args, path="args")
    assert "'args.init_method'" in str(ei.value) and "function" in str(ei.value)

    out = loads(dumps(args, lossy=True))
    assert out.lr == 1.0 and out.dt is torch.float16
    assert isinstance(out.init_method, Unrepresentable)
    assert out.init_method.type_name == "function" and "lambda" in out.init_method.repr
    assert isinstance(out.model, Unrepresentable) and out.model.type_name == "object"
    # Re-saving a loaded checkpoint's args works without lossy and keeps the placeholder.
    again = loads(dumps(out))
    assert same(again, out)


# --------------------------------------------------------------------------- save-time errors


def _local_enum():
    class Local(enum.Enum):
        A = 1

    return Local.A


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("value, path, typename", [
    ({"optimizer": {"param_groups": [{"betas": object()}]}}, "optimizer.param_groups[0].betas", "object"),
    ({"optimizer": {"state": {3: {"fn": len}}}}, "optimizer.state[3].fn", "builtin_function_or_method"),
    ([1, (2, {None: math})], "[1][1][None]", "module"),
    ({"p": Point(1, 2)}, "p", "Point"),
    ({"e": _local_enum()}, "e", "Local"),
    ({"a": np.array([1, None], dtype=object)}, "a", "numpy.ndarray"),
    ({"t": torch.zeros(2)}, "t", "torch.Tensor"),
    ({"mv": memoryview(b"x")}, "mv", "memoryview"),
    ({"dd": collections.defaultdict(list)}, "dd", "collections.defaultdict"),
])
def test_save_errors_name_the_path(value, path, typename):
    with pytest.raises(StateDictError) as ei:
        encode(value)
    msg = str(ei.value)
    assert f"cannot save {path!r}" in msg
    assert typename in msg
    assert "convert it to a JSON type, or wrap it in a ShardedObject/LocalNonpersistentObject" in msg


def test_save_error_path_prefix_and_circular():
    loop: list = [1]
    loop.append({"back": loop})
    with pytest.raises(StateDictError, match=r"'state\.x\[1\]\.back'.*circular"):
        encode({"x": loop}, path="state")
    # A shared (non-circular) reference is fine and simply stored twice.
    shared = [1, 2]
    assert same(roundtrip({"a": shared, "b": shared}), {"a": [1, 2], "b": [1, 2]})


def test_root_path_shown():
    with pytest.raises(StateDictError, match="<root>"):
        encode(object())


# --------------------------------------------------------------------------- malformed input


def _b(data: bytes) -> str:
    return base64.b64encode(data).decode()


MALFORMED = [
    ({TAG: "nope"}, "unknown tag"),
    ({TAG: 5}, "unknown tag"),
    ({TAG: "tuple"}, "missing"),
    ({TAG: "tuple", "items": [], "extra": 1}, "unexpected"),
    ({TAG: "tuple", "items": "abc"}, "items"),
    ({TAG: "int", "hex": "0x10"}, "hex"),
    ({TAG: "int", "hex": "1_0"}, "hex"),
    ({TAG: "float", "v": "1.5"}, "float"),
    ({TAG: "bytes", "b64": "!!!"}, "base64"),
    ({TAG: "bytes", "b64": "é"}, "base64"),
    ({TAG: "dict", "items": [[1]]}, "pair"),
    ({TAG: "dict", "items": [[[1], 2]]}, "unhashable"),
    ({TAG: "set", "items": [[1]]}, "malformed"),
    ({TAG: "ndarray", "dtype": "<f4", "shape": [2], "b64": _b(b"\0" * 4)}, "needs 8 bytes"),
    ({TAG: "ndarray", "dtype": "O", "shape": [1], "b64": _b(b"\0" * 8)}, "object"),
    ({TAG: "ndarray", "dtype": "<i4,<f4", "shape": [1], "b64": _b(b"\0" * 8)}, "structured"),
    ({TAG: "ndarray", "dtype": "zz9", "shape": [1], "b64": ""}, "numpy dtype"),
    ({TAG: "ndarray", "dtype": "<f4", "shape": [-1], "b64": ""}, "shape"),
    ({TAG: "npscalar", "dtype": "<f8", "b64": _b(b"\0")}, "needs 8 bytes"),
    ({TAG: "int", "hex": "f" * 70000}, "hex digits"),
    ({TAG: "enum", "module": Color.__module__, "qualname": "Color", "name": "BLUE"}, "no member"),
    ({TAG: "enum", "module": Color.__module__, "qualname": "Color", "value": 2}, "not a Flag"),
    ({TAG: "torch.dtype", "name": "Tensor"}, "no dtype"),
    ({TAG: "torch.dtype", "name": "__class__"}, "no dtype"),
    ({TAG: "torch.Size", "dims": [1, -2]}, "dims"),
    ({TAG: "torch.device", "type": "cuda", "index": "0"}, "index"),
    ({TAG: "torch.device", "type": "nosuchdevice", "index": None}, "malformed"),
    ({TAG: "complex", "real": "a", "imag": 0.0}, "floats"),
    ({TAG: "namespace", "attrs": {TAG: "dict", "items": [[1, 2]]}}, "str-keyed"),
    ({TAG: "BytesIO", "b64": "", "pos": -1}, "negative"),
    ({TAG: "ref", "ref": 1}, "resolver"),
    ({TAG: "repr", "repr": 3, "type": "x"}, "repr"),
]


@pytest.mark.parametrize("bad, needle", MALFORMED)
def test_malformed_tags_raise_checkpoint_error_with_path(bad, needle):
    doc = {"a": {"b": [0, bad]}}
    with pytest.raises(CheckpointError) as ei:
        loads(json.dumps(doc), strict=True)
    msg = str(ei.value)
    assert "'a.b[1]'" in msg, msg
    assert needle in msg, msg


UNREGISTERED_ENUMS = [
    {TAG: "enum", "module": "megashard_no_such_module_xyz", "qualname": "E", "name": "A"},
    {TAG: "enum", "module": "this", "qualname": "E", "name": "A"},
    {TAG: "enum", "module": "unittest.__main__", "qualname": "E", "name": "A"},
    {TAG: "enum", "module": "os", "qualname": "path", "name": "sep"},
    {TAG: "enum", "module": "os; rm", "qualname": "E", "name": "A"},
    {TAG: "enum", "module": "enum", "qualname": "Enum", "value": 3},
]


@pytest.mark.parametrize("bad", UNREGISTERED_ENUMS)
def test_unregistered_enum_never_imports(bad, monkeypatch, caplog):
    """Decoding resolves enums only through the registry: no import, whatever the module."""
    import builtins
    import importlib
    import sys

    before = set(sys.modules)

    def refuse(*a, **k):
        raise AssertionError(f"decode imported {a[0]!r}")

    monkeypatch.setattr(importlib, "import_module", refuse)
    monkeypatch.setattr(builtins, "__import__", refuse)
    doc = json.dumps({"a": [bad]})
    with pytest.raises(CheckpointError, match="register_enum"):
        loads(doc, strict=True)
    out = loads(doc)
    monkeypatch.undo()
    assert isinstance(out["a"][0], Unrepresentable)
    assert "not registered" in caplog.text
    assert set(sys.modules) == before


def test_registered_enum_roundtrip_and_register_enum_checks():
    assert same(loads(dumps([Color.RED, Perm.R | Perm.X, Outer.Inner.A])), [Color.RED, Perm.R | Perm.X, Outer.Inner.A])
    with pytest.raises(TypeError):
        jsonstate.register_enum(int)


def test_depth_and_size_limits():
    deep: Any = 0
    for _ in range(jsonstate.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(CheckpointError, match="nested deeper"):
        decode(deep)
    with pytest.raises(CheckpointError, match="nested too deeply|not valid JSON"):
        parse_json("[" * 1_000_000 + "]" * 1_000_000, "x")
    with pytest.raises(CheckpointError, match="64 bits"):
        decode({"x": 2**70})


def test_invalid_json_text():
    with pytest.raises(CheckpointError, match="^state 3: not valid JSON"):
        parse_json("{not json", "state 3")
    with pytest.raises(CheckpointError, match="^state 3: not valid JSON"):
        parse_json("1" * 5000, "state 3")  # beyond Python's int-digit limit


def test_decode_rejects_non_json_python_objects():
    with pytest.raises(CheckpointError, match="'x'"):
        decode({"x": object()})


# --------------------------------------------------------------------------- never unpickle

_PWNED: list = []


def _pwn():
    _PWNED.append("executed")
    return "pwned"


class _Evil:
    def __reduce__(self):
        return (_pwn, ())


def test_decode_never_unpickles(monkeypatch):
    payload = pickle.dumps(_Evil())
    b64 = _b(payload)
    doc = {
        "bytes": {TAG: "bytes", "b64": b64},
        "bytearray": {TAG: "bytearray", "b64": b64},
        "bio": {TAG: "BytesIO", "b64": b64, "pos": 0},
        "arr": {TAG: "ndarray", "dtype": "|u1", "shape": [len(payload)], "b64": b64},
        "void": {TAG: "ndarray", "dtype": f"|V{len(payload)}", "shape": [], "b64": b64},
        "scalar": {TAG: "npscalar", "dtype": f"|S{len(payload)}", "b64": b64},
        "repr": {TAG: "repr", "type": "pickle", "repr": payload.decode("latin-1")},
        "tensor": {TAG: "ref", "ref": {"b64": b64}},
    }

    def boom(*a, **k):
        raise AssertionError("pickle used during decode")

    import _pickle
    for mod, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                      (pickle, "_loads"), (pickle, "_load"), (pickle, "_Unpickler"),
                      (_pickle, "loads"), (_pickle, "load"), (_pickle, "Unpickler"),
                      (np, "load"), (torch, "load")]:
        monkeypatch.setattr(mod, name, boom)

    refs = []
    out = loads(json.dumps(doc), resolver=lambda ref, path: refs.append(ref) or torch.zeros(1))
    assert not _PWNED
    assert out["bytes"] == payload and type(out["bytes"]) is bytes
    assert out["bytearray"] == bytearray(payload)
    assert out["bio"].getvalue() == payload
    assert out["arr"].tobytes() == payload and out["arr"].dtype == np.uint8
    assert out["void"].tobytes() == payload
    assert out["scalar"].tobytes() == payload
    assert isinstance(out["repr"], Unrepresentable)
    assert refs == [{"b64": b64}]  # handed to the resolver verbatim, not decoded


# --------------------------------------------------------------------------- misc


def test_errors_are_megashard_errors():
    assert issubclass(StateDictError, MegashardError) and issubclass(CheckpointError, MegashardError)
    assert set(jsonstate.TAGS) >= {"int", "float", "tuple", "dict", "namespace", "enum", "ndarray",
                                   "npscalar", "bytes", "ref", "repr", "torch.dtype"}


def test_every_tag_is_documented():
    doc = jsonstate.__doc__
    for tag in jsonstate.TAGS:
        assert f'{{T: "{tag}",' in doc, tag


def test_big_trees_round_trip():
    """Megatron-sized args and optimizer state (speed is the benchmarks' business)."""
    args = argparse.Namespace(**{f"arg_{i}": (i if i % 3 else [i, float(i), None]) for i in range(600)})
    args.params_dtype = torch.bfloat16
    opt = {"state": {i: {"step": i, "exp_avg_sq_scale": 0.5, "betas": (0.9, 0.95)} for i in range(8000)},
           "param_groups": [{"params": list(range(8000)), "lr": 1e-4}]}
    value = {"args": args, "optimizer": opt, "iteration": 5}
    assert same(loads(dumps(value)), value)
