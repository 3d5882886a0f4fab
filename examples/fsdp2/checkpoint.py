"""This script's own export of the trained model (a module named ``checkpoint``, as many training folders have):
a consolidated copy of the weights written with ``torch.distributed.checkpoint`` at the end of training. The
guard's per-step checkpoints are separate; this file only shows that a module of this name beside a script
does not collide with trainguard's."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict


def export(model: torch.nn.Module, folder: str | Path) -> None:
    """Write the model's weights (every rank writes its shards; DCP plans the files) under ``folder``."""
    dcp.save(get_model_state_dict(model), checkpoint_id=str(folder))
