"""Moving copies and small JSON documents between ranks over the checkpoint's own gloo groups.

Never the training groups: the checkpoint library creates two gloo groups of
its own (``control`` for the small all-gathers, ``data`` for copies), so a
replica in flight never queues behind, or delays, a training collective.

A copy travels as a fixed-size int64 header (magic, step, ok flag, manifest
length, part count, then per part its length and file index), the manifest, and
the file parts, each received straight into its slice of one buffer per file.
``ok = 0`` says "I have no good copy to send" and nothing follows, so a
receiver never waits for data that will not come. Step -1 ends a stream.
Acknowledgements are a separate tag, so the two directions between a pair of
ranks that back each other up never cross-match.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

MAGIC = 0x7467636B  # "tgck"
MAX_PARTS = 8
HEADER = 5 + 2 * MAX_PARTS
TAG_COPY = 11
TAG_ACK = 12
TAG_RESTORE = 13
END_OF_STREAM = -1


class WireError(RuntimeError):
    """The other side sent something that is not a copy (a protocol or version mismatch)."""


def _as_tensor(part: Any) -> torch.Tensor:
    if isinstance(part, torch.Tensor):
        return part.reshape(-1).view(torch.uint8) if part.dtype != torch.uint8 else part.reshape(-1)
    buf = part if isinstance(part, bytearray) else bytearray(part)
    return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)


def send_copy(group: Any, dst: int, *, step: int, manifest: bytes = b"",
              files: Sequence[tuple[str, Sequence[Any]]] = (), ok: bool = True, tag: int = TAG_COPY) -> None:
    """Send one copy (``files`` as ``(name, parts)``; parts are bytes-like or uint8 tensors)."""
    parts: list[tuple[int, torch.Tensor]] = []
    if ok:
        for index, (_name, file_parts) in enumerate(files):
            parts += [(index, _as_tensor(p)) for p in file_parts]
    if len(parts) > MAX_PARTS:
        raise WireError(f"a copy of {len(parts)} parts exceeds the wire's {MAX_PARTS}")
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[:5] = torch.tensor([MAGIC, step, int(ok), len(manifest) if ok else 0, len(parts)])
    for i, (index, t) in enumerate(parts):
        header[5 + 2 * i] = t.numel()
        header[6 + 2 * i] = index
    dist.send(header, dst, group=group, tag=tag)
    if not ok or step == END_OF_STREAM:
        return
    dist.send(_as_tensor(manifest), dst, group=group, tag=tag)
    for _index, t in parts:
        if t.numel():
            dist.send(t, dst, group=group, tag=tag)


def end_stream(group: Any, dst: int, tag: int = TAG_COPY) -> None:
    send_copy(group, dst, step=END_OF_STREAM, ok=False, tag=tag)


def recv_copy(group: Any, src: int, *, tag: int = TAG_COPY) -> tuple[int, bool, bytes, list[memoryview]]:
    """Receive one copy: ``(step, ok, manifest bytes, file contents in manifest order)``."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    dist.recv(header, src, group=group, tag=tag)
    magic, step, ok, manifest_len, nparts = (int(v) for v in header[:5])
    if magic != MAGIC or not 0 <= nparts <= MAX_PARTS:
        raise WireError(f"rank {src} sent a header that is not a checkpoint copy")
    if not ok or step == END_OF_STREAM:
        return step, False, b"", []
    manifest = torch.empty(manifest_len, dtype=torch.uint8)
    if manifest_len:
        dist.recv(manifest, src, group=group, tag=tag)
    sizes: dict[int, int] = {}
    layout = []
    for i in range(nparts):
        length, index = int(header[5 + 2 * i]), int(header[6 + 2 * i])
        layout.append((index, sizes.get(index, 0), length))
        sizes[index] = sizes.get(index, 0) + length
    buffers = {index: torch.empty(size, dtype=torch.uint8) for index, size in sizes.items()}
    for index, begin, length in layout:
        if length:
            dist.recv(buffers[index][begin:begin + length], src, group=group, tag=tag)
    files = [memoryview(buffers[i].numpy()) for i in sorted(buffers)]
    return step, True, bytes(manifest.numpy()), files


def send_ack(group: Any, dst: int, step: int, ok: bool) -> None:
    dist.send(torch.tensor([step, int(ok)], dtype=torch.int64), dst, group=group, tag=TAG_ACK)


def recv_ack(group: Any, src: int) -> tuple[int, bool]:
    ack = torch.zeros(2, dtype=torch.int64)
    dist.recv(ack, src, group=group, tag=TAG_ACK)
    return int(ack[0]), bool(ack[1])


def gather_json(doc: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's ``doc`` (JSON-serialisable), in rank order; an all-gather on ``group`` (no pickle)."""
    if group is None or world_size == 1:
        return [json.loads(json.dumps(doc))]
    data = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [json.loads(bytes(t[:int(s)].numpy()).decode("utf-8")) for t, s in zip(out, sizes, strict=True)]
