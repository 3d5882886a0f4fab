"""Hugging Face ``Trainer`` under trainguard: GPT-2 built from a configuration (2 layers, nothing downloaded),
trained by the stock ``transformers.Trainer`` with DDP, guarded by one callback.

Runs under torchrun (each process one device) or alone::

    torchrun --nproc-per-node 2 examples/hf/train.py --steps 50
    python examples/hf/train.py --steps 50 --checkpoint-dir /tmp/ckpt

The data are synthetic token sequences that follow a fixed random bigram table. The lines marked
``# trainguard`` are all the guard asks of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from trainguard.torch import TrainguardError, checkpoint_config_from_env  # trainguard
from trainguard.transformers import TrainguardCallback  # trainguard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hf-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to run; 0 = until stopped (default 100)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--samples", type=int, default=2048, help="sequences in the data set (one epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0,
                   help="sleep this long in each step, as a real model's compute would take (paces a demo)")
    p.add_argument("--checkpoint-dir", default="",
                   help="checkpoint root when run outside a trainguard launch (a launch sets TG_CHECKPOINT)")
    return p.parse_args(argv)


class BigramTokens(Dataset):
    """Sequence ``i``: tokens that follow a fixed random bigram table 90% of the time (a function of ``i``)."""

    def __init__(self, samples: int, seq: int, vocab: int, seed: int) -> None:
        self.samples, self.seq, self.vocab, self.seed = samples, seq, vocab, seed
        self.table = torch.randint(0, vocab, (vocab,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        tokens = torch.empty(self.seq, dtype=torch.long)
        tokens[0] = int(torch.randint(0, self.vocab, (1,), generator=g))
        for t in range(1, self.seq):
            keep = bool(torch.rand(1, generator=g) < 0.9)
            tokens[t] = self.table[tokens[t - 1]] if keep else int(torch.randint(0, self.vocab, (1,), generator=g))
        return {"input_ids": tokens, "labels": tokens.clone()}


class Report(TrainerCallback):
    """Prints each step's loss (rank 0) and paces the steps like a bigger model's compute."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):  # the Trainer's signature
        if self.seconds > 0:
            time.sleep(self.seconds)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step - 1} loss {logs['loss']:.6f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    output = os.environ.get("TG_RUN_DIR") or tempfile.mkdtemp(prefix="hf-demo-")
    training = TrainingArguments(output_dir=os.path.join(output, "hf-output"), max_steps=args.steps or 10**9,
                                 per_device_train_batch_size=args.batch, learning_rate=1e-3, warmup_steps=10,
                                 lr_scheduler_type="constant_with_warmup",
                                 logging_steps=1, save_strategy="no", report_to=[], seed=args.seed,
                                 use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                                 ddp_find_unused_parameters=False,
                                 ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None)
    checkpoint = checkpoint_config_from_env(root=args.checkpoint_dir) if args.checkpoint_dir else None  # trainguard
    guard = TrainguardCallback(checkpoint=checkpoint)  # trainguard
    data = BigramTokens(args.samples, args.seq, args.vocab, args.seed)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[guard, Report(args.step_time_s)])
    try:
        trainer.train(resume_from_checkpoint=guard.restore(trainer))  # trainguard: restore first
    except TrainguardError as exc:  # e.g. checkpoints exist but none can be restored: one line
        guard.close("failed")
        print(f"hf-demo: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException:
        guard.close("failed")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
