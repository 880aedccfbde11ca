"""Non-tensor checkpoint state <-> JSON, exactly and without pickle.

Checkpoints carry plenty of small non-tensor state: Megatron's ``args`` Namespace,
the iteration, LR-scheduler dicts, RNG states, optimizer ``param_groups`` and the
int-keyed optimizer ``state`` dict. torch.save would pickle all of it, which makes
loading a checkpoint equivalent to running code. megashard stores it as JSON instead:

* :func:`encode` turns a value into a JSON-serialisable structure. Plain JSON values
  stay plain; everything else uses a *tagged form*, a JSON object with the reserved
  key ``"__ms__"`` naming the tag. Anything that has no tagged form is refused at
  **save** time with a :class:`~megashard.errors.StateDictError` naming the full key
  path (``optimizer.param_groups[0].betas``), so a checkpoint never half-works.
* :func:`decode` is the exact inverse: values come back equal *and of the same type*
  (tuple stays tuple, int keys stay int, ``-0.0`` keeps its sign, NaN stays NaN,
  ``np.float32`` stays ``np.float32``). Malformed or unknown tags raise
  :class:`~megashard.errors.CheckpointError` naming the path. Decoding never
  unpickles, never imports a module named by the data and never calls arbitrary
  constructors: byte payloads come back as bytes, enums resolve only through the
  :func:`register_enum` registry. Nesting deeper than :data:`MAX_DEPTH` and integers
  longer than :data:`MAX_INT_HEX_DIGITS` hex digits are refused with CheckpointError.

Hooks: the checkpoint layer moves tensors (and other file-backed values) out of the
tree. ``encode(..., hook=h)`` calls ``h(path, value)`` for every value that is not
None/bool/int/float/str/list/dict, before any built-in handling; ``h`` returns
:data:`UNHANDLED` to let jsonstate encode the value, or a plain-JSON reference that is
embedded *by reference* (the caller may still fill it in before ``json.dumps``) in a
``ref`` tag. A tensor the hook does not take is refused (tensors belong in
``.tensors`` files). On load, ``decode(..., resolver=r)`` calls ``r(ref, path)`` for
every ``ref`` tag and uses its result as is; a ``ref`` with no resolver is a
CheckpointError. The output of encode is strict JSON for ``json.dumps`` (no NaN/Infinity
literals); untrusted text is parsed with :func:`parse_json`.

Key paths: dict string keys are joined with ``.``, list/tuple/set positions and
non-string dict keys are written ``[i]`` / ``[repr(key)]``, Namespace attributes
with ``.``; the root is ``""`` (shown as ``<root>``).

Plain JSON (no tag)
-------------------
``None``, ``bool``, ``str``, ``list``, finite ``float`` (including ``-0.0``, which
JSON writes as ``-0.0``), ``int`` in ``[-2**63, 2**63)``, and ``dict`` whose keys
are all exactly ``str`` and do not include ``"__ms__"``.

Tagged forms
------------
Every tagged object has exactly the keys listed (``T`` stands for ``"__ms__"``; an
*encoded* value is itself plain JSON or a tagged form)::

    {T: "int",         "hex": "-1f..."}           int outside [-2**63, 2**63), lowercase hex
                                                  (interoperable with 64-bit JSON readers)
    {T: "float",       "v": "nan"|"inf"|"-inf"}   non-finite float (NaN sign/payload not kept)
    {T: "complex",     "real": enc, "imag": enc}  Python complex
    {T: "tuple",       "items": [enc, ...]}
    {T: "set",         "items": [enc, ...]}       sorted when the elements are orderable
    {T: "frozenset",   "items": [enc, ...]}
    {T: "dict",        "items": [[enc key, enc value], ...]}
                                                  dict with any non-str key, or with a
                                                  "__ms__" key (escaping); keeps key order
    {T: "OrderedDict", "items": [[enc key, enc value], ...]}
    {T: "namespace",   "attrs": enc dict}         argparse.Namespace (exact type)
    {T: "enum", "module": m, "qualname": q, "name": member}
    {T: "enum", "module": m, "qualname": q, "value": int}
                                                  enum.Enum member; the "value" form only
                                                  for composite enum.Flag values. Decoding
                                                  never imports: "m.q" must have been
                                                  registered with :func:`register_enum`
                                                  (megashard.megatron registers Megatron's);
                                                  otherwise the value decodes to an
                                                  :class:`Unrepresentable` with a warning,
                                                  or fails when ``strict=True``.
    {T: "torch.dtype",  "name": "bfloat16"}
    {T: "torch.Size",   "dims": [int, ...]}
    {T: "torch.device", "type": "cuda", "index": int|null}
    {T: "ref",          "ref": <JSON from the save hook, verbatim>}
                                                  a value the checkpoint layer stored
                                                  elsewhere (a tensor, a ShardedTensor or
                                                  ShardedObject, large bytes) and replaced
                                                  by a reference; decode needs a resolver
    {T: "ndarray",  "dtype": "<f4", "shape": [int, ...], "b64": base64}
                                                  numpy array (exact type), C-order raw
                                                  bytes; dtype is numpy's dtype.str (byte
                                                  order kept); object/structured refused
    {T: "npscalar", "dtype": "<i8", "b64": base64}
                                                  numpy scalar (np.float64, np.int64,
                                                  np.bool_, np.str_, ...), raw bytes
    {T: "bytes",     "b64": base64}
    {T: "bytearray", "b64": base64}
    {T: "BytesIO",   "b64": base64, "pos": int}   io.BytesIO content and position
    {T: "repr", "type": "module.QualName", "repr": str}
                                                  placeholder written only with
                                                  encode(..., lossy=True) (used for
                                                  Megatron args); decodes to
                                                  :class:`Unrepresentable`

base64 is the standard alphabet with padding. Notes: object identity/sharing is not
preserved (a list referenced twice is stored twice); circular references are refused;
numpy arrays come back C-contiguous and writable.

Anything else (functions, modules, arbitrary objects, subclasses of the builtin types
such as namedtuples, tensors no hook took) raises
:class:`~megashard.errors.StateDictError`: convert it to a JSON type, or wrap it in a
ShardedObject/LocalNonpersistentObject.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import collections
import enum
import io
import json
import logging
import math
import re
import sys
from typing import Any, Callable, Dict, List, Optional

from .errors import CheckpointError, MegashardError, StateDictError

logger = logging.getLogger(__name__)

__all__ = [
    "TAG",
    "TAGS",
    "MAX_DEPTH",
    "register_enum",
    "parse_json",
    "UNHANDLED",
    "Unrepresentable",
    "UnregisteredEnum",
    "encode",
    "decode",
]

#: The one reserved key that marks a tagged form.
TAG = "__ms__"

_INT_MIN = -(2**63)
_INT_MAX = 2**63 - 1
_HEX_RE = re.compile(r"-?[0-9a-f]+\Z")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_REPR_LIMIT = 4096
#: Deepest nesting decode accepts (a state dict is rarely deeper than 10).
MAX_DEPTH = 200
#: Longest tagged integer decode accepts, in hex digits (262,144 bits).
MAX_INT_HEX_DIGITS = 65536

_ENUMS: Dict[str, type] = {}


def register_enum(cls: type) -> type:
    """Allow ``cls``'s members to be decoded (usable as a class decorator).

    Decoding resolves enums only through this registry, so a checkpoint can never make
    the loader import a module.
    """
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise TypeError(f"register_enum needs an enum.Enum subclass, got {cls!r}")
    _ENUMS[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls
_ADVICE = "convert it to a JSON type, or wrap it in a ShardedObject/LocalNonpersistentObject"

Hook = Callable[[str, Any], Any]
Resolver = Callable[[Any, str], Any]


class _Unhandled:
    """Type of :data:`UNHANDLED` (a singleton; compare with ``is``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "megashard.jsonstate.UNHANDLED"

    def __reduce__(self) -> str:
        return "UNHANDLED"


#: Returned by a save ``hook`` that does not take a value: jsonstate encodes it itself.
UNHANDLED = _Unhandled()


class Unrepresentable:
    """Stand-in for a value that ``encode(..., lossy=True)`` could not store.

    Keeps the original type name and ``repr`` so that a loaded Megatron ``args``
    still shows what was there. Saving it again writes the same placeholder.
    """

    __slots__ = ("repr", "type_name")

    def __init__(self, repr: str, type_name: str = "") -> None:  # noqa: A002 - mirrors the tag field
        self.repr = repr
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"Unrepresentable({self.repr!r}, type_name={self.type_name!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Unrepresentable):
            return NotImplemented
        return self.repr == other.repr and self.type_name == other.type_name

    def __hash__(self) -> int:
        return hash((Unrepresentable, self.repr, self.type_name))


class UnregisteredEnum(Unrepresentable):
    """Placeholder for an enum member whose class was not registered with :func:`register_enum`.

    Keeps the stored tag, so saving it again writes the same enum value back."""

    __slots__ = ("tag",)

    def __init__(self, repr: str, type_name: str, tag: Dict[str, Any]) -> None:  # noqa: A002
        super().__init__(repr, type_name)
        self.tag = dict(tag)


def _show(path: str) -> str:
    return path if path else "<root>"


def _key_path(path: str, key: Any) -> str:
    if type(key) is str:
        return f"{path}.{key}" if path else key
    try:
        r = repr(key)
    except Exception:  # a key whose repr fails must not hide the real error
        r = f"<{type(key).__name__}>"
    return f"{path}[{r}]"


def _type_name(t: type) -> str:
    mod = getattr(t, "__module__", None)
    qn = getattr(t, "__qualname__", getattr(t, "__name__", "?"))
    return qn if mod in (None, "builtins") else f"{mod}.{qn}"


def _safe_repr(v: Any) -> str:
    try:
        r = repr(v)
    except Exception as e:  # noqa: BLE001 - a placeholder must never fail
        r = f"<{_type_name(type(v))} object; repr() failed: {type(e).__name__}>"
    if len(r) > _REPR_LIMIT:
        r = r[: _REPR_LIMIT - 3] + "..."
    return r


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _is_plain_json(x: Any) -> bool:
    t = type(x)
    if x is None or t is str or t is bool or t is int:
        return True
    if t is float:
        return math.isfinite(x)
    if t is list:
        return all(_is_plain_json(i) for i in x)
    if t is dict:
        return all(type(k) is str and _is_plain_json(v) for k, v in x.items())
    return False


# --------------------------------------------------------------------------- encode


class _Encoder:
    __slots__ = ("lossy", "hook", "active")

    def __init__(self, lossy: bool, hook: Optional[Hook]) -> None:
        self.lossy = lossy
        self.hook = hook
        self.active: set = set()  # ids of mutable containers on the current path (cycle check)

    def refuse(self, v: Any, path: str, why: str = "") -> Any:
        if self.lossy:
            logger.debug("jsonstate: storing %s (%s) as a repr placeholder", _show(path), type(v))
            return {TAG: "repr", "type": _type_name(type(v)), "repr": _safe_repr(v)}
        extra = f" ({why})" if why else ""
        raise StateDictError(
            f"cannot save {_show(path)!r}: value of type {_type_name(type(v))} is not "
            f"JSON-representable{extra}; {_ADVICE}"
        )

    def enc(self, v: Any, path: str) -> Any:
        t = type(v)
        if t is str or t is bool or v is None:
            return v
        if t is int:
            if _INT_MIN <= v <= _INT_MAX:
                return v
            return {TAG: "int", "hex": format(v, "x")}
        if t is float:
            if math.isfinite(v):
                return v
            return {TAG: "float", "v": "nan" if v != v else ("inf" if v > 0 else "-inf")}
        if t is list:
            return self.container(v, path, self.list_)
        if t is dict:
            return self.container(v, path, self.dict_)
        if self.hook is not None:
            ref = self.hook(path, v)
            if ref is not UNHANDLED:
                return self.ref(ref, path)
        handler = _ENCODERS.get(t)
        if handler is not None:
            return handler(self, v, path)
        return self.other(v, path)

    def container(self, v: Any, path: str, fn: Callable[[Any, str], Any]) -> Any:
        i = id(v)
        if i in self.active:
            return self.refuse(v, path, "circular reference")
        self.active.add(i)
        try:
            return fn(v, path)
        finally:
            self.active.discard(i)

    def list_(self, v: list, path: str) -> list:
        enc = self.enc
        return [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]

    def dict_(self, v: dict, path: str) -> Any:
        enc = self.enc
        if TAG not in v and all(type(k) is str for k in v):
            return {k: enc(x, f"{path}.{k}" if path else k) for k, x in v.items()}
        return {TAG: "dict", "items": self.items(v, path)}

    def items(self, v: dict, path: str) -> List[List[Any]]:
        out = []
        for k, x in v.items():
            kp = _key_path(path, k)
            out.append([self.enc(k, kp), self.enc(x, kp)])
        return out

    def tuple_(self, v: tuple, path: str) -> Any:
        enc = self.enc
        return {TAG: "tuple", "items": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}

    def set_(self, v: Any, path: str) -> Any:
        try:
            elems = sorted(v)
        except Exception:  # noqa: BLE001 - unorderable mix: fall back to a stable-ish order
            try:
                elems = sorted(v, key=lambda x: (_type_name(type(x)), repr(x)))
            except Exception:  # noqa: BLE001
                elems = list(v)
        enc = self.enc
        tag = "set" if type(v) is set else "frozenset"
        return {TAG: tag, "items": [enc(x, f"{path}[{i}]") for i, x in enumerate(elems)]}

    def odict(self, v: dict, path: str) -> Any:
        return self.container(v, path, lambda d, p: {TAG: "OrderedDict", "items": self.items(d, p)})

    def namespace(self, v: argparse.Namespace, path: str) -> Any:
        def body(ns: argparse.Namespace, p: str) -> Any:
            return {TAG: "namespace", "attrs": self.dict_(vars(ns), p)}

        return self.container(v, path, body)

    def complex_(self, v: complex, path: str) -> Any:
        return {TAG: "complex", "real": self.enc(v.real, path), "imag": self.enc(v.imag, path)}

    def bytes_(self, v: Any, path: str) -> Any:
        return {TAG: "bytes" if type(v) is bytes else "bytearray", "b64": _b64(bytes(v))}

    def bytesio(self, v: io.BytesIO, path: str) -> Any:
        return {TAG: "BytesIO", "b64": _b64(v.getvalue()), "pos": v.tell()}

    def unrepresentable(self, v: Unrepresentable, path: str) -> Any:
        if isinstance(v, UnregisteredEnum):
            return dict(v.tag)
        return {TAG: "repr", "type": v.type_name, "repr": v.repr}

    def other(self, v: Any, path: str) -> Any:
        """Types that need isinstance checks or optional modules (numpy, torch)."""
        t = type(v)
        if isinstance(v, enum.Enum):
            return self.enum_(v, path)
        np = sys.modules.get("numpy")
        if np is not None:
            if t is np.ndarray:
                return self.ndarray(v, path, np)
            if isinstance(v, np.generic):
                return self.npscalar(v, path, np)
        torch = sys.modules.get("torch")
        if torch is not None:
            if t is torch.dtype:
                name = str(v).rpartition(".")[2]
                if _torch_dtypes().get(name) is not v:
                    return self.refuse(v, path, f"torch dtype {v} has no torch.{name} alias")
                return {TAG: "torch.dtype", "name": name}
            if t is torch.Size:
                return {TAG: "torch.Size", "dims": [int(d) for d in v]}
            if t is torch.device:
                return {TAG: "torch.device", "type": v.type, "index": v.index}
            if isinstance(v, torch.Tensor):
                return self.refuse(
                    v, path, "tensors belong in .tensors files; the checkpoint layer moves them there "
                    "through a save hook"
                )
        return self.refuse(v, path)

    def enum_(self, v: enum.Enum, path: str) -> Any:
        cls = type(v)
        module, qualname = cls.__module__, cls.__qualname__
        obj: Any = sys.modules.get(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is not cls:
            return self.refuse(
                v, path, f"enum class {module}.{qualname} cannot be found again by import "
                "(defined inside a function?)"
            )
        out: Dict[str, Any] = {TAG: "enum", "module": module, "qualname": qualname}
        name = v._name_
        if name is not None and cls.__members__.get(name) is v:
            out["name"] = name
        elif isinstance(v, enum.Flag) and type(v._value_) is int:
            out["value"] = v._value_
        else:
            return self.refuse(v, path, "enum member without a name")
        return out

    def ndarray(self, v: Any, path: str, np: Any) -> Any:
        dt = v.dtype
        why = _bad_np_dtype(dt, np)
        if why:
            return self.refuse(v, path, why)
        return {
            TAG: "ndarray",
            "dtype": dt.str,
            "shape": [int(s) for s in v.shape],
            "b64": _b64(v.tobytes(order="C")),
        }

    def npscalar(self, v: Any, path: str, np: Any) -> Any:
        dt = v.dtype
        why = _bad_np_dtype(dt, np, scalar=True)
        if why:
            return self.refuse(v, path, why)
        # numpy pads empty str_/bytes_ scalars in tobytes(); itemsize is the truth.
        data = v.tobytes() if dt.itemsize else b""
        return {TAG: "npscalar", "dtype": dt.str, "b64": _b64(data)}

    @staticmethod
    def ref(ref: Any, path: str) -> Any:
        if not _is_plain_json(ref):
            raise StateDictError(
                f"cannot save {_show(path)!r}: the save hook returned {type(ref).__name__} "
                f"{_safe_repr(ref)}, which is not plain JSON"
            )
        return {TAG: "ref", "ref": ref}  # by reference: the caller may complete it later


def _bad_np_dtype(dt: Any, np: Any, scalar: bool = False) -> str:
    """Why a numpy dtype cannot be stored as raw bytes ('' if it can): exactly the dtypes
    :func:`_np_dtype_from_str` reads back."""
    if dt.hasobject:
        return "numpy object dtype holds Python objects, not bytes"
    if dt.fields is not None or dt.subdtype is not None:
        return f"structured/subarray numpy dtype {dt} is not supported"
    if _np_dtype_from_str(dt.str, np) != dt:
        return f"numpy dtype {dt} does not survive dtype.str"
    if dt.itemsize == 0 and not (scalar and dt.kind in "SU"):
        return f"numpy dtype {dt} has zero-size items"
    return ""


# numpy dtype strings a checkpoint may hold: byte order, kind, item size (and a datetime unit).
# Anything else is refused before numpy parses it, so numpy's parser never sees arbitrary text.
_NP_DTYPE_RE = re.compile(r"([<>|=])(?:(b)(1)|([iu])(1|2|4|8)|(f)(2|4|8|12|16)|(c)(8|16|24|32)|([SUV])(\d{1,10})"
                          r"|([Mm])(8)(\[(?:[1-9]\d{0,8})?(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?)\Z")


def _np_dtype_from_str(s: str, np: Any) -> Any:
    """The numpy dtype of a ``dtype.str`` from the fixed grammar above, else None."""
    if type(s) is not str or not _NP_DTYPE_RE.match(s):
        return None
    try:
        return np.dtype(s)
    except (TypeError, ValueError):  # a size numpy has no type for (e.g. f12 on some platforms)
        return None


_TORCH_DTYPES: Dict[str, Any] = {}


def _torch_dtypes() -> Dict[str, Any]:
    """torch's dtypes by the name :func:`encode` writes (``str(dtype)`` without ``torch.``),
    taken from torch's module dictionary: looking a name up never imports anything (``torch``'s
    ``__getattr__`` imports submodules such as ``_dynamo`` on attribute access)."""
    if not _TORCH_DTYPES:
        import torch

        for v in list(vars(torch).values()):
            if isinstance(v, torch.dtype):
                _TORCH_DTYPES.setdefault(str(v).rpartition(".")[2], v)
    return _TORCH_DTYPES


_ENCODERS: Dict[type, Callable[[_Encoder, Any, str], Any]] = {
    tuple: _Encoder.tuple_,
    set: _Encoder.set_,
    frozenset: _Encoder.set_,
    collections.OrderedDict: _Encoder.odict,
    argparse.Namespace: _Encoder.namespace,
    complex: _Encoder.complex_,
    bytes: _Encoder.bytes_,
    bytearray: _Encoder.bytes_,
    io.BytesIO: _Encoder.bytesio,
    Unrepresentable: _Encoder.unrepresentable,
    UnregisteredEnum: _Encoder.unrepresentable,
}


def encode(
    value: Any,
    *,
    path: str = "",
    lossy: bool = False,
    hook: Optional[Hook] = None,
) -> Any:
    """Return a JSON-serialisable structure that :func:`decode` turns back into ``value``.

    ``path`` prefixes every key path in error messages and in hook calls.
    ``lossy=True`` stores unrepresentable values as ``repr`` placeholders instead of
    failing (meant for Megatron ``args``, which may hold functions). ``hook(path,
    value)`` sees every non-JSON-primitive value first and returns :data:`UNHANDLED` or
    a plain-JSON reference; tensors it does not take are refused.

    Raises StateDictError naming the key path of the first unrepresentable value.
    """
    return _Encoder(lossy, hook).enc(value, path)


# --------------------------------------------------------------------------- decode


class _Decoder:
    __slots__ = ("resolver", "strict", "depth")

    def __init__(self, resolver: Optional[Resolver], strict: bool = False) -> None:
        self.resolver = resolver
        self.strict = strict
        self.depth = 0

    def dec(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t is str or t is int or t is float or t is bool or obj is None:
            if t is int and not _INT_MIN <= obj <= _INT_MAX:
                raise CheckpointError(f"cannot load {_show(path)!r}: integer outside 64 bits stored untagged")
            return obj
        if t is not dict and t is not list:
            raise CheckpointError(
                f"cannot load {_show(path)!r}: {type(obj).__name__} is not a JSON value"
            )
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise CheckpointError(f"cannot load {_show(path)!r}: nested deeper than {MAX_DEPTH} levels")
            dec = self.dec
            if t is list:
                return [dec(x, f"{path}[{i}]") for i, x in enumerate(obj)]
            if TAG not in obj:
                return {k: dec(x, f"{path}.{k}" if path else k) for k, x in obj.items()}
            return self.tagged(obj, path)
        finally:
            self.depth -= 1

    def tagged(self, obj: dict, path: str) -> Any:
        tag = obj[TAG]
        handler = _DECODERS.get(tag) if type(tag) is str else None
        if handler is None:
            raise CheckpointError(
                f"cannot load {_show(path)!r}: unknown tag {TAG}={tag!r} (written by a newer "
                "megashard, or the file is corrupt)"
            )
        try:
            return handler(self, obj, path)
        except MegashardError:
            raise
        except Exception as e:  # malformed field contents: one error type for callers
            raise CheckpointError(
                f"cannot load {_show(path)!r}: malformed {tag!r} tagged value: "
                f"{type(e).__name__}: {e}"
            ) from e

    # --- field helpers
    @staticmethod
    def fields(obj: dict, path: str, required: Dict[str, Any], optional: tuple = ()) -> None:
        """Check the exact key set and the JSON type of each required field."""
        tag = obj[TAG]
        allowed = set(required) | set(optional) | {TAG}
        extra = [k for k in obj if k not in allowed]
        missing = [k for k in required if k not in obj]
        if extra or missing:
            raise CheckpointError(
                f"cannot load {_show(path)!r}: malformed {tag!r} tagged value "
                f"(missing {missing}, unexpected {extra})"
            )
        for k, types in required.items():
            v = obj[k]
            allowed_types = types if isinstance(types, tuple) else (types,)
            if types is not None and type(v) not in allowed_types:
                raise CheckpointError(
                    f"cannot load {_show(path)!r}: malformed {tag!r} tagged value "
                    f"(field {k!r} is {type(v).__name__})"
                )

    @staticmethod
    def unb64(s: str, path: str) -> bytes:
        try:
            return base64.b64decode(s.encode("ascii"), validate=True)
        except (binascii.Error, ValueError, UnicodeEncodeError) as e:
            raise CheckpointError(f"cannot load {_show(path)!r}: invalid base64 ({e})") from e

    def seq(self, obj: dict, path: str) -> List[Any]:
        self.fields(obj, path, {"items": list})
        dec = self.dec
        return [dec(x, f"{path}[{i}]") for i, x in enumerate(obj["items"])]

    def pairs(self, obj: dict, path: str, out: dict) -> dict:
        self.fields(obj, path, {"items": list})
        for i, kv in enumerate(obj["items"]):
            if type(kv) is not list or len(kv) != 2:
                raise CheckpointError(
                    f"cannot load {_show(path)!r}: item {i} of a dict is not a [key, value] pair"
                )
            k = self.dec(kv[0], f"{path}[key {i}]")
            try:
                hash(k)
            except TypeError:
                raise CheckpointError(
                    f"cannot load {_show(path)!r}: dict key {i} decodes to unhashable "
                    f"{type(k).__name__}"
                ) from None
            out[k] = self.dec(kv[1], _key_path(path, k))
        return out

    # --- tags
    def int_(self, obj: dict, path: str) -> int:
        self.fields(obj, path, {"hex": str})
        h = obj["hex"]
        if len(h) > MAX_INT_HEX_DIGITS + 1:
            raise CheckpointError(f"cannot load {_show(path)!r}: integer of {len(h)} hex digits "
                                  f"(limit {MAX_INT_HEX_DIGITS})")
        if not _HEX_RE.match(h):
            raise CheckpointError(f"cannot load {_show(path)!r}: bad hex integer {h[:40]!r}")
        return int(h, 16)

    def float_(self, obj: dict, path: str) -> float:
        self.fields(obj, path, {"v": str})
        v = obj["v"]
        if v not in ("nan", "inf", "-inf"):
            raise CheckpointError(f"cannot load {_show(path)!r}: bad float value {v!r}")
        return float(v)

    def complex_(self, obj: dict, path: str) -> complex:
        self.fields(obj, path, {"real": None, "imag": None})
        re_, im = self.dec(obj["real"], path), self.dec(obj["imag"], path)
        if type(re_) is not float or type(im) is not float:
            raise CheckpointError(f"cannot load {_show(path)!r}: complex parts must be floats")
        return complex(re_, im)

    def tuple_(self, obj: dict, path: str) -> tuple:
        return tuple(self.seq(obj, path))

    def set_(self, obj: dict, path: str) -> set:
        return set(self.seq(obj, path))

    def frozenset_(self, obj: dict, path: str) -> frozenset:
        return frozenset(self.seq(obj, path))

    def dict_(self, obj: dict, path: str) -> dict:
        return self.pairs(obj, path, {})

    def odict(self, obj: dict, path: str) -> collections.OrderedDict:
        return self.pairs(obj, path, collections.OrderedDict())

    def namespace(self, obj: dict, path: str) -> argparse.Namespace:
        self.fields(obj, path, {"attrs": dict})
        attrs = self.dec(obj["attrs"], path)
        if type(attrs) is not dict or not all(type(k) is str for k in attrs):
            raise CheckpointError(f"cannot load {_show(path)!r}: namespace attrs must be a str-keyed dict")
        ns = argparse.Namespace()
        ns.__dict__.update(attrs)
        return ns

    def enum_(self, obj: dict, path: str) -> enum.Enum:
        has_name = "name" in obj
        req: Dict[str, Any] = {"module": str, "qualname": str}
        req["name" if has_name else "value"] = str if has_name else int
        self.fields(obj, path, req)
        module, qualname = obj["module"], obj["qualname"]
        where = f"{module}.{qualname}"
        cls = _ENUMS.get(where)
        if cls is None:
            member_text = obj["name"] if has_name else str(obj["value"])
            msg = (f"enum {where} is not registered (megashard never imports a module named by a "
                   "checkpoint); call megashard.jsonstate.register_enum(cls) before loading")
            if self.strict:
                raise CheckpointError(f"cannot load {_show(path)!r}: {msg}")
            logger.warning("loading %r: %s; it is loaded as a placeholder", _show(path), msg)
            return UnregisteredEnum(f"<{qualname}.{member_text}>"[:_REPR_LIMIT], where[:_REPR_LIMIT], obj)
        if has_name:
            member = cls.__members__.get(obj["name"])
            if member is None:
                raise CheckpointError(
                    f"cannot load {_show(path)!r}: enum {where} has no member {obj['name']!r}"
                )
            return member
        if not issubclass(cls, enum.Flag):
            raise CheckpointError(f"cannot load {_show(path)!r}: enum {where} is not a Flag; 'value' form refused")
        member = cls(obj["value"])
        if not isinstance(member, cls):
            raise CheckpointError(f"cannot load {_show(path)!r}: {where}({obj['value']}) is not a member")
        return member

    def torch_dtype(self, obj: dict, path: str) -> Any:
        self.fields(obj, path, {"name": str})
        dt = _torch_dtypes().get(obj["name"])
        if dt is None:
            raise CheckpointError(f"cannot load {_show(path)!r}: torch has no dtype {obj['name'][:100]!r}")
        return dt

    def torch_size(self, obj: dict, path: str) -> Any:
        self.fields(obj, path, {"dims": list})
        import torch

        dims = obj["dims"]
        if not all(type(d) is int and d >= 0 for d in dims):
            raise CheckpointError(f"cannot load {_show(path)!r}: torch.Size dims must be ints >= 0")
        return torch.Size(dims)

    def torch_device(self, obj: dict, path: str) -> Any:
        self.fields(obj, path, {"type": str, "index": (int, type(None))})
        import torch

        if not _NAME_RE.match(obj["type"]):
            raise CheckpointError(f"cannot load {_show(path)!r}: bad device type {obj['type']!r}")
        idx = obj["index"]
        return torch.device(obj["type"]) if idx is None else torch.device(obj["type"], idx)

    def ref(self, obj: dict, path: str) -> Any:
        self.fields(obj, path, {"ref": None})
        if self.resolver is None:
            raise CheckpointError(
                f"cannot load {_show(path)!r}: it references a value stored outside the JSON, "
                "and no resolver was given"
            )
        return self.resolver(obj["ref"], path)

    @staticmethod
    def np_dtype(s: str, path: str, scalar: bool = False) -> Any:
        """A numpy dtype from the fixed grammar :func:`_np_dtype_from_str` accepts (never
        numpy's own parser on arbitrary text); zero-size items only for empty str/bytes scalars."""
        import numpy as np

        dt = _np_dtype_from_str(s, np)
        if dt is None:
            if "O" in s:
                why = f"numpy object dtype {s[:40]!r} holds Python objects, not bytes"
            elif "," in s or s.lstrip("<>|=")[:1] in ("(", "["):
                why = f"structured/subarray numpy dtype {s[:40]!r} is not supported"
            else:
                why = f"bad numpy dtype {s[:40]!r}"
            raise CheckpointError(f"cannot load {_show(path)!r}: {why}")
        if dt.itemsize == 0 and not (scalar and dt.kind in "SU"):
            raise CheckpointError(f"cannot load {_show(path)!r}: numpy dtype {s!r} has zero-size items (refused: "
                                  "no bytes could bound the array's shape)")
        return np, dt

    def ndarray(self, obj: dict, path: str) -> Any:
        self.fields(obj, path, {"dtype": str, "shape": list, "b64": str})
        np, dt = self.np_dtype(obj["dtype"], path)
        shape = obj["shape"]
        if len(shape) > 64 or not all(type(s) is int and s >= 0 for s in shape):
            raise CheckpointError(f"cannot load {_show(path)!r}: ndarray shape must be at most 64 ints >= 0")
        data = self.unb64(obj["b64"], path)
        n = math.prod(shape)
        if len(data) != n * dt.itemsize:  # items are never zero-size here: the bytes bound the shape
            raise CheckpointError(
                f"cannot load {_show(path)!r}: ndarray of {dt} {shape} needs {n * dt.itemsize} "
                f"bytes, found {len(data)}"
            )
        if n == 0:
            return np.zeros(shape, dtype=dt)
        return np.frombuffer(data, dtype=dt, count=n).reshape(shape).copy()

    def npscalar(self, obj: dict, path: str) -> Any:
        self.fields(obj, path, {"dtype": str, "b64": str})
        np, dt = self.np_dtype(obj["dtype"], path, scalar=True)
        data = self.unb64(obj["b64"], path)
        if len(data) != dt.itemsize:
            raise CheckpointError(
                f"cannot load {_show(path)!r}: numpy {dt} scalar needs {dt.itemsize} bytes, found {len(data)}"
            )
        if dt.itemsize == 0:
            return dt.type()
        return np.frombuffer(data, dtype=dt, count=1)[0]

    def bytes_(self, obj: dict, path: str) -> bytes:
        self.fields(obj, path, {"b64": str})
        return self.unb64(obj["b64"], path)

    def bytearray_(self, obj: dict, path: str) -> bytearray:
        return bytearray(self.bytes_(obj, path))

    def bytesio(self, obj: dict, path: str) -> io.BytesIO:
        self.fields(obj, path, {"b64": str, "pos": int})
        if obj["pos"] < 0:
            raise CheckpointError(f"cannot load {_show(path)!r}: negative BytesIO position")
        bio = io.BytesIO(self.unb64(obj["b64"], path))
        bio.seek(obj["pos"])
        return bio

    def repr_(self, obj: dict, path: str) -> Unrepresentable:
        self.fields(obj, path, {"type": str, "repr": str})
        return Unrepresentable(obj["repr"], obj["type"])


_DECODERS: Dict[str, Callable[[_Decoder, dict, str], Any]] = {
    "int": _Decoder.int_,
    "float": _Decoder.float_,
    "complex": _Decoder.complex_,
    "tuple": _Decoder.tuple_,
    "set": _Decoder.set_,
    "frozenset": _Decoder.frozenset_,
    "dict": _Decoder.dict_,
    "OrderedDict": _Decoder.odict,
    "namespace": _Decoder.namespace,
    "enum": _Decoder.enum_,
    "torch.dtype": _Decoder.torch_dtype,
    "torch.Size": _Decoder.torch_size,
    "torch.device": _Decoder.torch_device,
    "ref": _Decoder.ref,
    "ndarray": _Decoder.ndarray,
    "npscalar": _Decoder.npscalar,
    "bytes": _Decoder.bytes_,
    "bytearray": _Decoder.bytearray_,
    "BytesIO": _Decoder.bytesio,
    "repr": _Decoder.repr_,
}

#: Every tag this version reads and writes (documented in the module docstring).
TAGS = frozenset(_DECODERS)


def decode(
    obj: Any,
    *,
    path: str = "",
    resolver: Optional[Resolver] = None,
    strict: bool = False,
) -> Any:
    """Inverse of :func:`encode` for the output of ``json.loads``.

    A ``ref`` tag's reference (passed verbatim) goes to ``resolver(ref, path)``, whose
    result is used as is; without a resolver a ``ref`` is a CheckpointError.
    Raises CheckpointError naming the key path for unknown or malformed tags, nesting
    past :data:`MAX_DEPTH` and oversized integers. Unregistered enums become
    :class:`Unrepresentable` (with a warning), or raise when ``strict``. Never unpickles,
    never imports a module named by the data.
    """
    return _Decoder(resolver, strict).dec(obj, path)


def parse_json(text: "str | bytes", where: str) -> Any:
    """``json.loads`` for untrusted text: every failure (syntax, encoding, integer digit limit,
    nesting too deep for the parser) is a CheckpointError naming ``where``."""
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, int-digit limits
        raise CheckpointError(f"{where}: not valid JSON ({str(e)[:200]})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply to parse") from None
