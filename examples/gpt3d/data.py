"""Synthetic, seeded, learnable token data generated on the fly.

Sequences are walks of a fixed random Markov chain over the vocabulary: every
token has a few successors (``branching``) with skewed probabilities, so the
next-token entropy is low (about 1 nat) while the initial loss of a model is
``ln(vocab)``; a small GPT learns the transition table within a few dozen
steps.

The batch of ``(step, dp_index)`` is a pure function of ``(seed, step,
dp_index)``: no state is carried from one step to the next, so the position of
the "data loader" is just the step number (a checkpoint restores it by
restoring the step).
"""

from __future__ import annotations

import torch

from examples.gpt3d.model import derive_seed


class MarkovData:
    """Batches of ``[micro_batches, micro_batch_size, seq_len]`` inputs and targets."""

    def __init__(
        self, *, vocab: int, seq_len: int, micro_batches: int, micro_batch_size: int,
        seed: int, branching: int = 4, temperature: float = 1.5,
    ) -> None:
        if vocab < 2 or branching < 1 or branching > vocab:
            raise ValueError(f"need 1 <= branching ({branching}) <= vocab ({vocab}) and vocab >= 2")
        self.vocab = vocab
        self.seq_len = seq_len
        self.micro_batches = micro_batches
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        gen = torch.Generator().manual_seed(derive_seed(seed, "markov-chain", vocab, branching))
        self.successors = torch.stack(
            [torch.randperm(vocab, generator=gen)[:branching] for _ in range(vocab)]
        )  # [vocab, branching]
        self.probs = torch.softmax(torch.randn(vocab, branching, generator=gen) * temperature, dim=-1)
        self._cum = self.probs.cumsum(dim=-1)

    @property
    def tokens_per_batch(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len

    def batch(self, step: int, dp_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of one step for one DP replica, each ``[M, B, S]`` int64."""
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "batch", step, dp_index))
        rows = self.micro_batches * self.micro_batch_size
        uniform = torch.rand(rows, self.seq_len, generator=gen)
        tokens = torch.empty(rows, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab, (rows,), generator=gen)
        branching = self.successors.shape[1]
        for t in range(self.seq_len):
            cur = tokens[:, t]
            choice = (uniform[:, t : t + 1] > self._cum[cur]).sum(dim=-1).clamp_(max=branching - 1)
            tokens[:, t + 1] = self.successors[cur, choice]
        shape = (self.micro_batches, self.micro_batch_size, self.seq_len)
        return tokens[:, :-1].reshape(shape), tokens[:, 1:].reshape(shape)

    def entropy_rate(self) -> float:
        """The chain's next-token entropy in nats (the loss a perfect model reaches)."""
        transition = torch.zeros(self.vocab, self.vocab, dtype=torch.float64)
        transition.scatter_add_(1, self.successors, self.probs.double())
        stationary = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        for _ in range(200):
            stationary = stationary @ transition
        p = self.probs.double()
        row_entropy = -(p * p.clamp_min(1e-30).log()).sum(dim=-1)
        return float((stationary * row_entropy).sum())
