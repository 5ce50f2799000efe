"""Training data: deterministic synthetic token streams, or a local text file read as bytes.

Samples are addressed by (split, sample index) and each sample has its own generator, so any run
(eager or graphed, any split of the global batch into microbatches) sees the same tokens for the
same step. `batch(split, first, n)` returns samples first .. first+n-1. Nothing is downloaded.
`RankBatches` is one rank's share of every global batch, microbatch by microbatch.

Synthetic: sequences are concatenations of "phrases" (8 tokens each) drawn from a fixed phrase
book, with 2% of tokens replaced by noise. After a phrase's first token the rest is predictable,
so the loss falls quickly from ln(vocab) towards ~1 nat.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from graphsan.lab.train.config import TrainConfig

PHRASE_LEN = 8
NUM_PHRASES = 512
NOISE = 0.02
SPLITS = {"train": 0, "valid": 1}


def _generator(seed: int, split: str, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + SPLITS[split]) * 1_000_033 + index)


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        book = torch.Generator().manual_seed(seed)
        self.phrases = torch.randint(0, vocab_size, (NUM_PHRASES, PHRASE_LEN), generator=book)

    def sample(self, split: str, index: int) -> torch.Tensor:
        g = _generator(self.seed, split, index)
        n = -(-(self.seq_length + 1) // PHRASE_LEN)
        ids = torch.randint(0, NUM_PHRASES, (n,), generator=g)
        seq = self.phrases[ids].reshape(-1)[: self.seq_length + 1]
        noise = torch.rand(seq.shape, generator=g) < NOISE
        return torch.where(noise, torch.randint(0, self.vocab_size, seq.shape, generator=g), seq)

    def batch(self, split: str, first: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.stack([self.sample(split, first + i) for i in range(batch_size)])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class ByteFile:
    """A local file as a byte stream (vocab 256): the first 90% trains, the last 10% validates."""

    def __init__(self, path: str | Path, seq_length: int, seed: int):
        path = Path(path)
        if not path.is_file():
            what = (
                "a folder"
                if path.is_dir()
                else "not a regular file"
                if path.exists()
                else "no such file"
            )
            raise ValueError(f"--data-path {path}: {what}; expected a local text file")
        data = torch.from_numpy(np.fromfile(path, dtype=np.uint8).astype(np.int64))
        cut = int(len(data) * 0.9)
        self.parts = {"train": data[:cut], "valid": data[cut:]}
        for split, part in self.parts.items():
            if len(part) < seq_length + 2:
                raise ValueError(
                    f"--data-path {path}: the {split} part has {len(part)} bytes; expected at "
                    f"least seq-length + 2 = {seq_length + 2} (use a larger file or shorter "
                    "--seq-length)"
                )
        self.seq_length, self.seed = seq_length, seed

    def batch(self, split: str, first: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = self.parts[split]
        hi = len(part) - self.seq_length - 1
        starts = [
            int(torch.randint(0, hi, (1,), generator=_generator(self.seed, split, first + i)))
            for i in range(batch_size)
        ]
        seq = torch.stack([part[s : s + self.seq_length + 1] for s in starts])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def build_data(data_path: str | None, vocab_size: int, seq_length: int, seed: int):
    if data_path is None:
        return SyntheticTokens(vocab_size, seq_length, seed)
    if vocab_size < 256:
        raise ValueError(
            f"--data-path needs a vocabulary of >= 256 (bytes); the model has {vocab_size}"
        )
    return ByteFile(data_path, seq_length, seed)


class RankBatches:
    """This rank's microbatches: the global batch of each step is split across the ranks in
    rank order, each rank's share into its microbatches, so every split of the same global
    batch (ranks x microbatches x micro batch size) trains on the same samples."""

    def __init__(self, data, cfg: TrainConfig, rank: int, device: torch.device):
        self.data, self.rank, self.device = data, rank, device
        self.world, self.per_rank = cfg.world_size, cfg.num_microbatches
        self.micro_batch_size = cfg.micro_batch_size

    def first_sample(self, step: int, mb: int) -> int:
        """The first sample of microbatch `mb` of this rank in `step` (0-based)."""
        index = (step * self.world + self.rank) * self.per_rank + mb
        return index * self.micro_batch_size

    def get(self, split: str, step: int, mb: int, non_blocking: bool = False):
        """(tokens, labels) of microbatch `mb` of `step` (0-based) on the device."""
        tokens, labels = self.data.batch(split, self.first_sample(step, mb), self.micro_batch_size)
        return (
            tokens.to(self.device, non_blocking=non_blocking),
            labels.to(self.device, non_blocking=non_blocking),
        )
