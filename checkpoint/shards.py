"""Tensor files: a rank's training state as safetensors files built straight from flat buffers.

A rank's state is two files:

``model.safetensors``
    the model's ``state_dict()`` (this rank's TP/PP shard; of a model sharded with FSDP2's ``fully_shard``,
    this rank's local shard of each DTensor).
``optim.safetensors``
    the optimizer's tensor state (``state.<param index>.<key>``) and the random
    number generators (``rng.torch``, ``rng.cuda.<device>``, ``rng.numpy``).

Everything that is not a tensor (the optimizer's parameter groups, Python's RNG,
the data position) goes into the manifest as JSON. Nothing is pickled.

A :class:`ShardLayout` fixes where each tensor lives in one flat byte buffer, in
the order safetensors itself uses (widest dtype first, then by name), so that
the file is ``8-byte header length + JSON header + the buffer`` and writing a
snapshot never re-serialises tensor data: the buffer *is* the file body. Any
safetensors reader loads these files.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.safetensors"
STATE_FILES = (MODEL_FILE, OPTIM_FILE)

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint32: "U32", torch.uint16: "U16", torch.uint64: "U64",
}
_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"tensor dtype {dtype} cannot be stored in a safetensors checkpoint") from None


def dtype_of(code: str) -> torch.dtype:
    return _BY_CODE[code]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a file: safetensors dtype code, shape, and byte range in the data buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class ShardLayout:
    """Where every tensor of one file sits in its flat buffer, and the file header that describes it."""

    def __init__(self, entries: list[TensorEntry]) -> None:
        self.entries = entries
        self.data_bytes = entries[-1].end if entries else 0
        header = {e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
                  for e in entries}
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned, as safetensors writes it
        self.prefix = struct.pack("<Q", len(text)) + text
        self.signature = tuple((e.name, e.dtype, e.shape) for e in entries)

    @classmethod
    def for_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> ShardLayout:
        items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
        entries, offset = [], 0
        for name, t in items:
            n = t.numel() * t.element_size()
            entries.append(TensorEntry(name, dtype_code(t.dtype), tuple(t.shape), offset, offset + n))
            offset += n
        return cls(entries)

    @staticmethod
    def signature_of(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
        return tuple((name, dtype_code(t.dtype), tuple(t.shape)) for name, t in items)

    @property
    def file_size(self) -> int:
        return len(self.prefix) + self.data_bytes

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into ``flat`` (a uint8 tensor of ``data_bytes``), one per tensor."""
        out = {}
        for e in self.entries:
            out[e.name] = flat[e.begin:e.end].view(dtype_of(e.dtype)).view(e.shape)
        return out

    def describe(self) -> dict[str, dict[str, Any]]:
        """The manifest's view of the file's tensors: name -> dtype and shape."""
        return {e.name: {"dtype": e.dtype, "shape": list(e.shape)} for e in self.entries}


# ---------------------------------------------------------------------------------------
# What a rank's state is, and how it goes back
# ---------------------------------------------------------------------------------------
def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (the same storage, so later in-place updates show),
    any other tensor as it is, detached."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local().detach()
    return t.detach() if t.requires_grad else t


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and optimizer state)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"optimizer setting {value!r} ({type(value).__name__}) cannot be stored as JSON")


class StateReader:
    """Reads a rank's state for a snapshot, cheaply enough to run on the training thread every step.

    :meth:`read` returns ``({file: {name: tensor}}, raw_meta, key)``. The tensors are the live ones
    (parameters themselves, no copy); ``raw_meta`` holds Python objects as they are (RNG tuples,
    parameter groups) and becomes JSON later, off the training thread, through :func:`meta_json`.
    ``key`` changes whenever a different set of tensor objects makes up the state (the optimizer
    created its state, or a restore replaced it: see :meth:`_scan`); while it stays the same, the
    model's and optimizer's tensor references are reused instead of walking ``state_dict()`` again,
    and only the RNG states, the optimizer's non-tensor values and its parameter groups are read anew.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._key: tuple[Any, ...] | None = None
        self._model_refs: dict[str, torch.Tensor] = {}
        self._optim_refs: dict[str, torch.Tensor] = {}
        self._index: dict[int, int] = {}  # id(parameter) -> its index in the optimizer's state_dict
        self._scalar_refs: list[tuple[str, Any, str]] = []

    def _scan(self) -> tuple[Any, ...]:
        """A cheap key of which tensors make up the state: the optimizer's state mapping (a restore
        replaces it) and how many entries it holds (an optimizer creates its state lazily). torch's
        optimizers update their state tensors in place once created, so the same key means the same
        tensor objects."""
        if self.optimizer is None:
            return (len(self._model_refs),)
        state = self.optimizer.state
        return len(self._model_refs), id(state), len(state), sum(map(len, state.values()))

    def _scalars(self) -> dict[str, Any]:
        """The optimizer's non-tensor state values (e.g. an integer step), read anew each time."""
        return {name: self.optimizer.state[param][key] for name, param, key in self._scalar_refs} \
            if self.optimizer is not None else {}

    def _rebuild(self) -> None:
        self._model_refs = {name: local_part(t) for name, t in self.model.state_dict(keep_vars=True).items()}
        self._optim_refs = {}
        self._scalar_refs = []
        self._index = {}
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            order = [p for group in self.optimizer.param_groups for p in group["params"]]
            packed = [i for group in sd["param_groups"] for i in group["params"]]
            self._index = {id(p): i for p, i in zip(order, packed, strict=True)}
            for param, values in self.optimizer.state.items():
                for key, value in values.items():
                    name = f"{self._index[id(param)]}.{key}"
                    if isinstance(value, torch.Tensor):
                        self._optim_refs[f"state.{name}"] = local_part(value)
                    else:
                        self._scalar_refs.append((name, param, key))

    def read(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any], tuple[Any, ...]]:
        key = self._scan()
        if key != self._key:
            self._rebuild()
            key = self._key = self._scan()
        scalars = self._scalars()
        optim_tensors = dict(self._optim_refs)
        raw: dict[str, Any] = {"optimizer": None}
        if self.optimizer is not None:
            groups = []
            start = 0
            for group in self.optimizer.param_groups:
                packed = {k: v for k, v in group.items() if k != "params"}
                packed["params"] = [self._index[id(p)] for p in group["params"]] if self._index else \
                    list(range(start, start + len(group["params"])))
                start += len(group["params"])
                groups.append(packed)
            raw["optimizer"] = {"param_groups": groups, "scalars": scalars}
        optim_tensors["rng.torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                optim_tensors[f"rng.cuda.{i}"] = s
        raw["python_rng"] = random.getstate()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            kind, keys, pos, has_gauss, cached = numpy.random.get_state()
            optim_tensors["rng.numpy"] = torch.from_numpy(keys)
            raw["numpy_rng"] = (kind, pos, has_gauss, cached)
        return {MODEL_FILE: dict(self._model_refs), OPTIM_FILE: optim_tensors}, raw, key


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[
        dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """The rank's state now: ``({file: {name: tensor}}, raw_meta)`` (see :class:`StateReader`)."""
    tensors, raw, _key = StateReader(model, optimizer).read()
    return tensors, raw


def meta_json(raw: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``state`` from :func:`live_state`'s raw meta."""
    out: dict[str, Any] = {"optimizer": _json_value(raw["optimizer"]) if raw.get("optimizer") else None}
    version, internal, gauss = raw["python_rng"]
    out["python_rng"] = [version, list(internal), gauss]
    if raw.get("numpy_rng") is not None:
        kind, pos, has_gauss, cached = raw["numpy_rng"]
        out["numpy_rng"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return out


def _groups_from_json(groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        out.append({k: (v if k == "params" or not isinstance(v, list) else tuple(v)) for k, v in g.items()})
    return out


def _like(param: Any, value: Any) -> Any:
    """A saved local shard as a DTensor laid out like ``param`` (a scalar such as Adam's step stays as it is)."""
    if not isinstance(value, torch.Tensor) or value.shape != param.to_local().shape or value.dim() == 0:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _load_model(model: torch.nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(saved, strict=True)``; for a model with DTensor (FSDP2) entries, each saved local
    shard is copied into the live one."""
    live = model.state_dict(keep_vars=True)
    if not any(is_dtensor(t) for t in live.values()):
        model.load_state_dict(dict(saved), strict=True)
        return
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise RuntimeError(f"the saved model state does not fit the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, t in live.items():
            local = local_part(t)
            if tuple(local.shape) != tuple(saved[name].shape):
                raise RuntimeError(f"{name}: the saved shard has shape {tuple(saved[name].shape)}, this rank's "
                                   f"{tuple(local.shape)} (restore onto the layout and world size it was saved with)")
            local.copy_(saved[name])


def apply_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                tensors: Mapping[str, Mapping[str, torch.Tensor]], meta: Mapping[str, Any]) -> None:
    """Put a saved state back: parameters, optimizer state, every RNG. Bit for bit. A sharded (DTensor) state
    goes back into this rank's local shards, which must have the saved shapes (the same world size)."""
    _load_model(model, tensors[MODEL_FILE])
    optim = tensors[OPTIM_FILE]
    if optimizer is not None and meta.get("optimizer") is not None:
        state: dict[int, dict[str, Any]] = {}
        for name, t in optim.items():
            if name.startswith("state."):
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = t
        for name, value in meta["optimizer"].get("scalars", {}).items():
            index, key = name.split(".", 1)
            state.setdefault(int(index), {})[key] = value
        groups = _groups_from_json(meta["optimizer"]["param_groups"])
        # torch maps the saved groups' parameter indices onto the live parameters in order; a DTensor parameter's
        # state goes back as a DTensor on the parameter's mesh and placements
        live = [p for group in optimizer.param_groups for p in group["params"]]
        saved = [i for group in groups for i in group["params"]]
        for index, param in zip(saved, live, strict=False):
            if is_dtensor(param) and index in state:
                state[index] = {k: _like(param, v) for k, v in state[index].items()}
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(optim["rng.torch"].clone())
    cuda = sorted((int(n.rsplit(".", 1)[1]), t) for n, t in optim.items() if n.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for _, t in cuda])
    version, internal, gauss = meta["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    numpy = sys.modules.get("numpy")
    if numpy is not None and "rng.numpy" in optim and meta.get("numpy_rng"):
        n = meta["numpy_rng"]
        keys = optim["rng.numpy"].numpy().astype(numpy.uint32)
        numpy.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached"]))
