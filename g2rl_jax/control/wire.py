"""Values that cross a process or a file: JSON plus arrays, never pickle, and checked when read back.

    payload = encode(value)                                   # bytes: JSON of the value's structure + an .npz
    value = decode(payload, kinds=(Rollout, Example), schema=tuple[int, Rollout], where="key g2rl/sides/start")
    obj = to_json(value); value = from_json(obj, kinds, schema, where)   # the same inside a JSON file

A value is made of None, bool, int, float, str, bytes, lists, tuples, dicts, NumPy arrays and scalars of bool,
integer, float or complex dtype, and dataclass instances of the `kinds` the reader names. The JSON holds the
structure, each array is an entry of an uncompressed .npz (read with allow_pickle=False). Nothing read is executed:
a dataclass is rebuilt by calling the class the reader allowed with the fields it declares, and the whole value is
then checked against the reader's `schema` (a type expression: `tuple[int, list[str]]`, `dict[int, Rollout]`,
`X | None`, `Any`), each dataclass against its own annotations, and arrays named with shape letters (`ids_BxS`) for
their rank and for one size per letter across the instance's fields (the legend in g2rl_jax/__init__.py). Anything
else, a pickle planted where a value should be included, is `Refused`, in one line naming `where`.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import re
import struct
import types
import typing
import zipfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from g2rl_jax.control.errors import BadInput

MAGIC = b"g2rl-wire/1\n"
ARRAY_KINDS = "biufc"  # bool, signed and unsigned integers, floats, complex: never objects
_PLAIN = {type(None), bool, int, float, str}  # what JSON holds as is
_FAST = {int: {int}, float: {int, float}, str: {str}}  # a list[X] holding only these types is one
_SHAPE = re.compile(r"_([A-Z](?:x[A-Z])*)$")  # a name's shape suffix: logp_BxT -> "BxT"


class Refused(BadInput, ValueError):
    """What was read is not a value this version wrote: refused, nothing in it was run. The message is one line
    naming the key or the file; for the run it is bad input (control/errors.py's BadInput: exit 2)."""


# ------------------------------------------------------------------------------------------------ writing
def _tree(value, arrays: list[np.ndarray]):
    """The JSON structure of `value`; its arrays appended to `arrays` (the tags `_Reader.value` reads)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind not in ARRAY_KINDS or array.dtype.names is not None:
            raise TypeError(f"wire: an array of dtype {array.dtype} cannot be sent (bool, int, float, complex only)")
        arrays.append(array)
        return {"s" if isinstance(value, np.generic) else "a": len(arrays) - 1}
    for plain in (bool, int, float, str):  # an IntEnum (an exit code), a str subclass: their plain value
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, list):
        if set(map(type, value)) <= _PLAIN:  # a list of ids or texts: as is, at C speed
            return value
        return [_tree(v, arrays) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return {"t": [_tree(v, arrays) for v in value]}
    if isinstance(value, dict):
        if all(type(k) is str for k in value):
            return {"d": {k: _tree(v, arrays) for k, v in value.items()}}
        return {"m": [[_tree(k, arrays), _tree(v, arrays)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode("ascii")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _tree(getattr(value, f.name), arrays) for f in dataclasses.fields(value) if f.init}
        return {"c": type(value).__name__, "f": fields}
    raise TypeError(f"wire: a {type(value).__name__} cannot be sent (JSON values, arrays and dataclasses only)")


def _npz(arrays: list[np.ndarray]) -> bytes:
    if not arrays:
        return b""
    out = io.BytesIO()
    np.savez(out, **{str(i): a for i, a in enumerate(arrays)})
    return out.getvalue()


def encode(value) -> bytes:
    """`value` as MAGIC, the JSON's length (8 bytes), the JSON of its structure, then its arrays as an .npz."""
    arrays: list[np.ndarray] = []
    text = json.dumps(_tree(value, arrays), separators=(",", ":")).encode()
    return MAGIC + struct.pack(">Q", len(text)) + text + _npz(arrays)


def to_json(value) -> dict[str, Any]:
    """`value` as a JSON object (for a JSON file): its structure, and its arrays as a base64 .npz."""
    arrays: list[np.ndarray] = []
    tree = _tree(value, arrays)
    return {"wire": 1, "json": tree, "npz": base64.b64encode(_npz(arrays)).decode("ascii")}


# ------------------------------------------------------------------------------------------------ reading
def _array(member, size: int) -> np.ndarray:
    """One .npy entry of `size` bytes, its header checked before anything is allocated: a dtype of ARRAY_KINDS (no
    objects, no fields) and a shape whose bytes are the entry's own (a header cannot claim more than was sent)."""
    version = np.lib.format.read_magic(member)
    shape, fortran, dtype = (np.lib.format.read_array_header_1_0(member) if version == (1, 0)
                             else np.lib.format.read_array_header_2_0(member))
    if dtype.kind not in ARRAY_KINDS or dtype.names is not None or dtype.hasobject:
        raise ValueError(f"an array of dtype {dtype}")
    count = math.prod(shape)
    data = member.read()
    if count * dtype.itemsize != len(data) or member.tell() != size:
        raise ValueError(f"an array of shape {shape} and dtype {dtype} in {len(data)} bytes")
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C").copy()


def _arrays(data: bytes, where: str) -> list[np.ndarray]:
    """The arrays of an .npz written by `_npz`: stored entries 0.npy … n-1.npy, no objects, nothing else (read
    here entry by entry: `_array`)."""
    if not data:
        return []
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
            if [i.filename for i in infos] != [f"{i}.npy" for i in range(len(infos))] or any(
                    i.compress_type != zipfile.ZIP_STORED for i in infos):
                raise Refused(f"{where}: its arrays are not the .npz this version writes; refused, nothing in it "
                              "was run")
            arrays = []
            for info in infos:
                with zf.open(info) as member:
                    arrays.append(_array(member, info.file_size))
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to parse foreign bytes is a refusal
        raise Refused(f"{where}: its arrays cannot be read ({type(err).__name__}: {err}); refused, nothing in it "
                      "was run") from None
    return arrays


class _Reader:
    def __init__(self, arrays: list[np.ndarray], kinds: Iterable[type], where: str):
        self.arrays, self.where = arrays, where
        self.kinds = {k.__name__: k for k in kinds}
        self.used: set[int] = set()

    def refuse(self, what: str) -> Refused:
        return Refused(f"{self.where}: {what}; refused, nothing in it was run")

    def array(self, index) -> np.ndarray:
        if type(index) is not int or not 0 <= index < len(self.arrays) or index in self.used:
            raise self.refuse(f"array reference {index!r} is not one of its arrays")
        self.used.add(index)
        return self.arrays[index]

    def value(self, tree):
        """The value of a JSON structure written by `_tree` (the only tags it writes, with exactly their keys)."""
        if tree is None or type(tree) in (bool, int, float, str):
            return tree
        if type(tree) is list:
            if set(map(type, tree)) <= _PLAIN:
                return tree
            return [self.value(v) for v in tree]
        if type(tree) is not dict or len(tree) not in (1, 2):
            raise self.refuse(f"a {type(tree).__name__} where a value's tag should be")
        tag = next(iter(tree))
        body = tree[tag]
        if tag == "t" and len(tree) == 1 and type(body) is list:
            return tuple(self.value(v) for v in body)
        if tag == "d" and len(tree) == 1 and type(body) is dict:
            return {k: self.value(v) for k, v in body.items()}
        if tag == "m" and len(tree) == 1 and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            pairs = [(self.value(k), self.value(v)) for k, v in body]
            if not all(isinstance(k, typing.Hashable) for k, _ in pairs):
                raise self.refuse("a dict key that is not hashable")
            return dict(pairs)
        if tag == "a" and len(tree) == 1:
            return self.array(body)
        if tag == "s" and len(tree) == 1:
            scalar = self.array(body)
            if scalar.ndim:
                raise self.refuse(f"a scalar of shape {scalar.shape}")
            return scalar[()]
        if tag == "b" and len(tree) == 1 and type(body) is str:
            try:
                return base64.b64decode(body, validate=True)
            except ValueError:
                raise self.refuse("bytes that are not base64") from None
        if tag == "c" and set(tree) == {"c", "f"} and type(body) is str and type(tree["f"]) is dict:
            return self.instance(body, tree["f"])
        raise self.refuse(f"an unknown tag {sorted(tree)}")

    def instance(self, name: str, fields: dict):
        cls = self.kinds.get(name)
        if cls is None:
            raise self.refuse(f"a {name!r}, which is not one of the kinds read here ({sorted(self.kinds)})")
        declared = {f.name for f in dataclasses.fields(cls) if f.init}
        if set(fields) != declared:
            raise self.refuse(f"a {name} with fields {sorted(fields)}, not {sorted(declared)}")
        values = {k: self.value(v) for k, v in fields.items()}
        problem = _instance_problem(cls, values)
        if problem:
            raise self.refuse(f"{name}.{problem}")
        try:
            return cls(**values)
        except Exception as err:  # noqa: BLE001 - the class's own checks refused the fields
            raise self.refuse(f"a {name} its class refuses ({type(err).__name__}: {err})") from None


def _structure(text: bytes, where: str):
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise Refused(f"{where}: its structure is not JSON ({err}); refused, nothing in it was run") from None


def _checked(tree, arrays, kinds, schema, where: str):
    reader = _Reader(arrays, kinds, where)
    try:
        value = reader.value(tree)
    except RecursionError:
        raise reader.refuse("a structure nested deeper than Python reads") from None
    if len(reader.used) != len(arrays):
        raise reader.refuse(f"{len(arrays) - len(reader.used)} arrays that nothing refers to")
    problem = conforms(value, schema)
    if problem:
        raise reader.refuse(f"not the value expected here: {problem}")
    return value


def decode(payload: bytes, kinds: Iterable[type] = (), schema=Any, where: str = "a value"):
    """The value `encode` wrote, checked against `schema` (see the module docstring); Refused otherwise."""
    if not payload.startswith(MAGIC) or len(payload) < len(MAGIC) + 8:
        raise Refused(f"{where}: not a value this version writes (JSON and arrays: a pickle, or another program's "
                      "bytes); refused, nothing in it was run")
    (size,) = struct.unpack(">Q", payload[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if start + size > len(payload):
        raise Refused(f"{where}: shorter than its header says; refused, nothing in it was run")
    tree = _structure(payload[start:start + size], where)
    return _checked(tree, _arrays(payload[start + size:], where), kinds, schema, where)


def from_json(obj, kinds: Iterable[type] = (), schema=Any, where: str = "a file"):
    """The value `to_json` wrote, checked as `decode` checks it."""
    if type(obj) is not dict or set(obj) != {"wire", "json", "npz"} or obj["wire"] != 1 or type(obj["npz"]) is not str:
        raise Refused(f"{where}: not a value this version writes (JSON and arrays); refused, nothing in it was run")
    try:
        npz = base64.b64decode(obj["npz"], validate=True)
    except ValueError:
        raise Refused(f"{where}: its arrays are not base64; refused, nothing in it was run") from None
    return _checked(obj["json"], _arrays(npz, where), kinds, schema, where)


# ------------------------------------------------------------------------------------------------ checking
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def conforms(value, hint) -> str | None:
    """None when `value` is of the type expression `hint`, else what differs, where (`[2].tokens: ...`)."""
    if hint is Any or hint is object:
        return None
    if hint is None or hint is type(None):
        return None if value is None else f"{type(value).__name__}, not None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        misses = [conforms(value, a) for a in args]
        return None if None in misses else f"{type(value).__name__} is none of {hint}"
    if origin is typing.Literal:
        return None if value in args else f"{value!r} is not one of {args}"
    simple = {int: _is_int, float: lambda x: _is_int(x) or isinstance(x, (float, np.floating)),
              bool: lambda x: isinstance(x, (bool, np.bool_)), str: lambda x: isinstance(x, str),
              bytes: lambda x: isinstance(x, bytes), np.ndarray: lambda x: isinstance(x, np.ndarray)}
    if hint in simple:
        return None if simple[hint](value) else f"a {type(value).__name__}, not {hint.__name__}"
    if dataclasses.is_dataclass(hint):
        return None if isinstance(value, hint) else f"a {type(value).__name__}, not {hint.__name__}"
    container = origin or hint
    if container in (list, tuple, dict, Mapping) and not isinstance(value, container):
        return f"a {type(value).__name__}, not {getattr(container, '__name__', container)}"
    if container is list:
        if args and args[0] in _FAST and set(map(type, value)) <= _FAST[args[0]]:  # ids, texts: at C speed
            return None
        return _first(((f"[{i}]", v, args[0]) for i, v in enumerate(value)) if args else ())
    if container is tuple:
        if not args:
            return None
        if len(args) == 2 and args[1] is Ellipsis:
            return _first((f"[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            return f"{len(value)} items, not {len(args)}"
        return _first((f"[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if container in (dict, Mapping):
        if not args:
            return None
        return _first(item for k, v in value.items() for item in ((f"[{k!r}] key", k, args[0]), (f"[{k!r}]", v,
                                                                                                  args[1])))
    raise TypeError(f"wire.conforms: no check for {hint!r}")


def _first(checks) -> str | None:
    for where, value, hint in checks:
        problem = conforms(value, hint)
        if problem:
            return f"{where}: {problem}"
    return None


def _instance_problem(cls, values: dict) -> str | None:
    """What is wrong with the fields `values` of a `cls` to be: a field not of its annotation, or an array whose
    shape letters (name suffix) disagree with its rank or with another field's size for the same letter."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        problem = conforms(value, hints.get(name, Any))
        if problem:
            return f"{name}: {problem}"
    sizes: dict[str, tuple[int, str]] = {}
    for name, value in values.items():
        match = _SHAPE.search(name)
        if match is None or not isinstance(value, np.ndarray):
            continue
        letters = match.group(1).split("x")
        if value.ndim != len(letters):
            return f"{name}: rank {value.ndim}, not {len(letters)} ({match.group(1)})"
        for letter, size in zip(letters, value.shape, strict=True):
            seen = sizes.setdefault(letter, (size, name))
            if seen[0] != size:
                return f"{name}: {letter} = {size}, but {seen[1]} has {letter} = {seen[0]}"
    return None
