"""A small GPT (decoder-only transformer) split for tensor and pipeline parallelism.

Tensor parallelism follows Megatron-LM: each block's attention splits its heads
across the TP ranks (a column-parallel QKV projection, a row-parallel output
projection) and its MLP splits the hidden layer (a column-parallel ``fc1``, a
row-parallel ``fc2``). Two conjugate autograd functions carry the communication:

``copy_to_tp``
    identity forward, all-reduce of the gradient backward (in front of a
    column-parallel layer: every TP rank needs the full input, and the input's
    gradient is the sum of what each rank's shard contributes);
``reduce_from_tp``
    all-reduce forward, identity backward (behind a row-parallel layer: the
    partial products of the shards are summed).

LayerNorms, the row-parallel biases, the embeddings and the LM head are
replicated on every TP rank (their parameters carry ``tensor_parallel = False``).

Pipeline parallelism: a :class:`Stage` holds a contiguous run of blocks; the
first stage also holds the token and position embeddings, the last the final
LayerNorm and the LM head (the loss is computed there).

Weights are initialised independently of the layout: each full (unsharded)
weight is drawn from a ``torch.Generator`` seeded from ``(seed, layer, name)``
and this rank's TP shard is sliced out of it. A run with TP=1 and one with TP=2
therefore start from the same full model, which is what lets the tests compare
their losses.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: ``wrap(group_kind, op)`` returns a context manager put around each collective
#: (the training script passes ``JobMonitor.collective``).
CollectiveWrap = Callable[[str, str], contextlib.AbstractContextManager[Any]]


def derive_seed(*parts: object) -> int:
    """A 32-bit seed that is a pure function of ``parts`` (stable across processes and runs)."""
    return zlib.crc32(":".join(str(p) for p in parts).encode("utf-8"))


def _no_wrap(group: str, op: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


class TPComm:
    """What the tensor-parallel layers need to know about their TP group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        size: int = 1,
        rank: int = 0,
        wrap: CollectiveWrap | None = None,
    ) -> None:
        self.group = group
        self.size = size
        self.rank = rank
        self.wrap = wrap or _no_wrap

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the TP group."""
        if self.size > 1:
            with self.wrap("tp", "all_reduce"):
                dist.all_reduce(tensor, group=self.group)
        return tensor


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_reduce_(grad.clone(memory_format=torch.contiguous_format)), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        return comm.all_reduce_(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over the TP group backward."""
    return _CopyToTP.apply(x, comm) if comm.size > 1 else x


def reduce_from_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """All-reduce over the TP group forward; identity backward."""
    return _ReduceFromTP.apply(x, comm) if comm.size > 1 else x


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq_len: int = 64
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    mlp_ratio: int = 4
    init_std: float = 0.02


class Init:
    """Draws full weights deterministically from ``(seed, layer, name)``."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self.device = torch.device(device)

    def normal(self, layer: object, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, layer, name))
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _param(full: torch.Tensor, device: torch.device, *, tensor_parallel: bool) -> nn.Parameter:
    p = nn.Parameter(full.contiguous().to(device))
    p.tensor_parallel = tensor_parallel  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split across the TP ranks (output stays sharded).

    ``fused`` > 1 means the output is ``fused`` equal blocks (e.g. Q, K, V) and each
    block is split separately, so every rank gets its own slice of each block.
    """

    def __init__(
        self, in_features: int, out_features: int, comm: TPComm, init: Init, layer: object,
        name: str, *, fused: int = 1, std: float = 0.02,
    ) -> None:
        super().__init__()
        if out_features % (fused * comm.size):
            raise ValueError(f"{name}: {out_features} outputs do not split into {fused} x {comm.size} shards")
        self.comm = comm
        block = out_features // fused
        local = block // comm.size
        lo, hi = comm.rank * local, (comm.rank + 1) * local
        weight = init.normal(layer, f"{name}.weight", (out_features, in_features), std)
        weight = weight.view(fused, block, in_features)[:, lo:hi].reshape(fused * local, in_features)
        self.weight = _param(weight, init.device, tensor_parallel=True)
        self.bias = _param(torch.zeros(fused * local), init.device, tensor_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split across the TP ranks (input comes sharded)."""

    def __init__(
        self, in_features: int, out_features: int, comm: TPComm, init: Init, layer: object,
        name: str, *, std: float = 0.02,
    ) -> None:
        super().__init__()
        if in_features % comm.size:
            raise ValueError(f"{name}: {in_features} inputs do not split into {comm.size} shards")
        self.comm = comm
        local = in_features // comm.size
        lo, hi = comm.rank * local, (comm.rank + 1) * local
        weight = init.normal(layer, f"{name}.weight", (out_features, in_features), std)[:, lo:hi]
        self.weight = _param(weight, init.device, tensor_parallel=True)
        self.bias = _param(torch.zeros(out_features), init.device, tensor_parallel=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.comm) + self.bias


class LayerNorm(nn.Module):
    """A LayerNorm whose (replicated) parameters are marked ``tensor_parallel = False``."""

    def __init__(self, dim: int, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(torch.ones(dim), device, tensor_parallel=False)
        self.bias = _param(torch.zeros(dim), device, tensor_parallel=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias)


class ParallelAttention(nn.Module):
    """Causal multi-head self-attention with the heads split across the TP ranks."""

    def __init__(self, cfg: GPTConfig, comm: TPComm, init: Init, layer: int) -> None:
        super().__init__()
        if cfg.heads % comm.size:
            raise ValueError(f"{cfg.heads} heads do not split across {comm.size} TP ranks")
        self.local_heads = cfg.heads // comm.size
        self.head_dim = cfg.d_model // cfg.heads
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        d = cfg.d_model
        self.qkv = ColumnParallelLinear(d, 3 * d, comm, init, layer, "attn.qkv", fused=3, std=cfg.init_std)
        self.proj = RowParallelLinear(d, d, comm, init, layer, "attn.proj", std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj(y)


class ParallelMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, comm: TPComm, init: Init, layer: int) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.fc1 = ColumnParallelLinear(cfg.d_model, hidden, comm, init, layer, "mlp.fc1", std=cfg.init_std)
        self.fc2 = RowParallelLinear(hidden, cfg.d_model, comm, init, layer, "mlp.fc2", std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig, comm: TPComm, init: Init, layer: int) -> None:
        super().__init__()
        self.ln1 = LayerNorm(cfg.d_model, init.device)
        self.attn = ParallelAttention(cfg, comm, init, layer)
        self.ln2 = LayerNorm(cfg.d_model, init.device)
        self.mlp = ParallelMLP(cfg, comm, init, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    """The layers of one pipeline stage, as seen by one TP rank.

    The first stage takes token ids ``[batch, seq]``; the others take the previous
    stage's activations ``[batch, seq, d_model]``. The last stage returns logits
    ``[batch, seq, vocab]``; the others return activations.
    """

    def __init__(
        self, cfg: GPTConfig, *, stage: int, stages: int, comm: TPComm | None = None,
        seed: int = 1234, device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if cfg.layers % stages:
            raise ValueError(f"{cfg.layers} layers do not split evenly into {stages} pipeline stages")
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of {cfg.heads} heads")
        comm = comm or TPComm()
        init = Init(seed, device)
        self.cfg = cfg
        self.stage = stage
        self.stages = stages
        self.is_first = stage == 0
        self.is_last = stage == stages - 1
        per_stage = cfg.layers // stages
        self.layer_ids = list(range(stage * per_stage, (stage + 1) * per_stage))
        if self.is_first:
            self.tok_emb = _param(init.normal("embed", "tok", (cfg.vocab, cfg.d_model), cfg.init_std),
                                  init.device, tensor_parallel=False)
            self.pos_emb = _param(init.normal("embed", "pos", (cfg.seq_len, cfg.d_model), cfg.init_std),
                                  init.device, tensor_parallel=False)
        self.blocks = nn.ModuleList(Block(cfg, comm, init, layer) for layer in self.layer_ids)
        if self.is_last:
            self.ln_f = LayerNorm(cfg.d_model, init.device)
            self.head = _param(init.normal("head", "weight", (cfg.vocab, cfg.d_model), cfg.init_std),
                               init.device, tensor_parallel=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = F.embedding(x, self.tok_emb) + self.pos_emb[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = F.linear(self.ln_f(x), self.head)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction (last stage only)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def replicated_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters that every TP rank holds in full (counted once in the grad norm)."""
        return (p for p in self.parameters() if not getattr(p, "tensor_parallel", False))


def full_parameter_count(cfg: GPTConfig) -> int:
    """Parameters of the whole (unsharded, unpipelined) model."""
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (h * d + h) + (d * h + d)
    return cfg.vocab * d + cfg.seq_len * d + cfg.layers * block + 2 * d + cfg.vocab * d
