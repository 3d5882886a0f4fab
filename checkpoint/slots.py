"""The snapshot buffers: one flat uint8 tensor per state file with typed views into it, the copy into
them, and a plain reference copy to measure checkpoint blocking against."""

from __future__ import annotations

import time
from typing import Any

import torch

from trainguard.checkpoint.saverproto import non_finite
from trainguard.checkpoint.shards import MODEL_FILE, OPTIM_FILE, ShardLayout, StateReader


class Slot:
    """One pre-allocated snapshot buffer: a flat uint8 tensor per file, typed views into it."""

    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]], pin: bool, identity: tuple[Any, ...],
                 flats: dict[str, torch.Tensor] | None = None) -> None:
        self.layouts = {name: ShardLayout.for_tensors(ts) for name, ts in tensors.items()}
        self.flats = flats if flats is not None else {
            name: torch.empty(lay.data_bytes, dtype=torch.uint8, pin_memory=pin) for name, lay in self.layouts.items()}
        self.index = -1  # its number at the saver process (saver "process")
        self.mapped: list[Any] = []  # the shared-memory files its buffers live in (saver "process")
        self.views = {name: lay.views(self.flats[name]) for name, lay in self.layouts.items()}
        self.signature = {name: lay.signature for name, lay in self.layouts.items()}
        self.identity = identity
        self._pairs: tuple[Any, list[torch.Tensor], list[torch.Tensor], list[tuple[str, str]]] | None = None
        self.busy = False
        self.step = -1
        self.meta: dict[str, Any] = {}
        self.data_position: dict[str, Any] = {}
        self.event: Any = None

    def fits(self, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...]) -> bool:
        """Whether ``tensors`` has this slot's layout (same tensor objects: no need to look closer)."""
        if identity == self.identity:
            return True
        if {name: ShardLayout.signature_of(ts) for name, ts in tensors.items()} == self.signature:
            self.identity = identity
            return True
        return False

    def copy_from(self, tensors: dict[str, dict[str, torch.Tensor]], non_blocking: bool,
                  identity: tuple[Any, ...] | None = None) -> None:
        """Copy ``tensors`` in. With ``identity`` (the same tensor objects as the last copy with it), the
        pairs of live tensors and buffer views are reused; the RNG states (new objects each step) are
        paired anew."""
        if identity is None or self._pairs is None or self._pairs[0] != identity:
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            rng: list[tuple[str, str]] = []
            for name, ts in tensors.items():
                views = self.views[name]
                for key, t in ts.items():
                    if key.startswith("rng."):
                        rng.append((name, key))
                    else:
                        dst.append(views[key])
                        src.append(t)
            self._pairs = (identity, dst + [self.views[n][k] for n, k in rng], src, rng)
        _, dst, src, rng = self._pairs
        with torch.no_grad():
            copy_all(dst, src + [tensors[n][k] for n, k in rng], non_blocking)

    def non_finite(self) -> str:
        """The first floating-point tensor of the snapshot holding a NaN or an infinity ("" if none): the
        saver process's check (:func:`trainguard.checkpoint.saverproto.non_finite`), on this buffer."""
        for name, lay in self.layouts.items():
            bad = non_finite(memoryview(self.flats[name].numpy()), entries(lay))
            if bad:
                return f"{bad} ({name})"
        return ""

    def parts(self, name: str) -> list[Any]:
        return [self.layouts[name].prefix, memoryview(self.flats[name].numpy())]


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool) -> None:
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src, non_blocking=non_blocking)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=non_blocking)


def entries(lay: ShardLayout) -> list[list[Any]]:
    """A layout's tensors as the saver takes them: ``[name, dtype, shape, begin, end]``."""
    return [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in lay.entries]


def timed_copy(slot: Slot, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...],
                cuda: bool) -> float:
    t0 = time.perf_counter()
    slot.copy_from(tensors, non_blocking=cuda, identity=identity)
    if cuda:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


class ReferenceCopy:
    """A plain copy of a rank's whole state (the tensors a snapshot holds) into a spare buffer, pinned on
    GPU hosts, timed: what checkpoint blocking is measured against, in runs of its own."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._reader = StateReader(model, optimizer)
        self._slot: Slot | None = None
        self.cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())

    def measure(self) -> float:
        tensors, _meta, key = self._reader.read()
        identity = (key, tuple(tensors[MODEL_FILE]), tuple(tensors[OPTIM_FILE]))
        if self._slot is None or not self._slot.fits(tensors, identity):
            self._slot = Slot(tensors, self.cuda, identity)
        return timed_copy(self._slot, tensors, identity, self.cuda)


def pin(flat: torch.Tensor, log: Any) -> None:
    """Page-lock a shared-memory buffer for the device-to-host copies (CUDA hosts)."""
    rc = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(rc) != 0:
        log(f"could not page-lock a {flat.numel()}-byte snapshot buffer (cudaHostRegister returned {int(rc)}); "
            f"device-to-host copies into it are synchronous", kind="pin")
