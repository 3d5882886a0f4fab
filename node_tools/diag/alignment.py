"""The bit-wise alignment test, run in a worker process: a fixed tiny model, deterministic steps, one digest."""

from __future__ import annotations

import hashlib
import math
import os
import platform
import random
from typing import Any

from trainguard.node_tools.diag.common import (
    ALIGN_ENV,
    done,
    fault_points,
    finite,
    load_cfg,
)


def run_align(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    cfg = load_cfg(args)
    faults = fault_points(cfg)
    seed, steps = int(args.get("seed", 0)), int(args.get("steps", 1))
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        # deterministic cuBLAS/cuDNN kernels; on the CPU the pins of ALIGN_ENV do that, and the switch
        # would import torch._dynamo and torch._inductor (seconds of CPU on every machine at once)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    # Weights from Python's generator (the same on every platform) rounded to float32:
    # torch's own randn takes a different path on different vector units.
    rng = random.Random(seed)  # noqa: S311 - reproducible test data

    def tensor(*shape: int, scale: float) -> Any:
        count = math.prod(shape)
        return torch.tensor([rng.uniform(-1.0, 1.0) * scale for _ in range(count)],
                            dtype=torch.float32).reshape(shape).to(dev)

    d_in, d_hidden, d_out, batch = 32, 64, 16, 8
    params = {
        "w1": tensor(d_hidden, d_in, scale=0.25), "b1": tensor(d_hidden, scale=0.125),
        "w2": tensor(d_out, d_hidden, scale=0.125), "b2": tensor(d_out, scale=0.125),
    }
    for p in params.values():
        p.requires_grad_(True)
    x, target = tensor(batch, d_in, scale=1.0), tensor(batch, d_out, scale=1.0)
    lr = 0.125
    h_all, h_out, h_grad, h_weight = (hashlib.sha256() for _ in range(4))
    losses, flipped = [], 0

    def feed(hashes: tuple[Any, ...], t: Any) -> None:
        raw = bytes(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).tolist())
        for h in hashes:
            h.update(raw)

    for _ in range(steps):
        hidden = torch.relu(x @ params["w1"].T + params["b1"])
        out = hidden @ params["w2"].T + params["b2"]
        loss = ((out - target) ** 2).mean()
        for p in params.values():
            p.grad = None
        loss.backward()
        if faults.corrupt_compute(params["w1"].grad):  # a broken ALU, as in a training rank's gradients
            flipped += 1
        feed((h_all, h_out), out)
        feed((h_all, h_out), loss)
        for p in params.values():
            feed((h_all, h_grad), p.grad)
        with torch.no_grad():
            for p in params.values():
                p -= lr * p.grad
        for p in params.values():
            feed((h_all, h_weight), p)
        losses.append(finite(float(loss.detach())))
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    capability = torch.backends.cpu.get_cpu_capability()
    details = {
        "digest": h_all.hexdigest(),
        "parts": {"outputs": h_out.hexdigest(), "grads": h_grad.hexdigest(), "weights": h_weight.hexdigest()},
        "losses": losses, "device": str(dev), "device_name": name, "torch": torch.__version__,
        "cpu_capability": capability, "threads": torch.get_num_threads(), "steps": steps, "seed": seed,
        "compare_key": f"{platform.machine()} {dev.type}:{name}|torch {torch.__version__}|aten {capability}"
                       f"|seed {seed} steps {steps}",
        "pinned_env": {k: os.environ.get(k) for k in ALIGN_ENV},
    }
    if flipped:
        details["sdc_flips"] = flipped
    return done(True, details)
