"""The GPT's data: the text (a file, or the generated corpus) as character ids, cut into train and
validation windows, and the loaders that hand each rank its share of every epoch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import corpus
import torch
from gpt_config import TrainConfig
from gpt_device import Dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of block_size + 1 characters (input and shifted target)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block = data, block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : i * self.block + self.block + 1]
        return chunk[:-1], chunk[1:]


def load_text(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    return corpus.generate()


@dataclass
class Corpus:
    """The text's vocabulary (its characters, sorted, and their ids) and its first 90 % (train) and
    last 10 % (validation) as windows."""

    chars: list[str]
    stoi: dict[str, int]
    train: CharDataset
    val: CharDataset


def read_corpus(path: str | None, block_size: int) -> Corpus:
    text = load_text(path)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return Corpus(chars, stoi, CharDataset(data[:split], block_size), CharDataset(data[split:], block_size))


@dataclass
class Loaders:
    """Each rank's batches: the train set shuffled anew every epoch (train_sampler.set_epoch), the
    validation set in order; an epoch is steps_per_epoch optimizer steps."""

    train_sampler: DistributedSampler[int]
    train: DataLoader
    val: DataLoader
    steps_per_epoch: int


def make_loaders(data: Corpus, d: Dist, tc: TrainConfig) -> Loaders:
    # A sampler yields the dataset's indices.
    train_sampler: DistributedSampler[int] = DistributedSampler(
        data.train, num_replicas=d.world, rank=d.rank, shuffle=True, seed=tc.seed
    )
    val_sampler: DistributedSampler[int] = DistributedSampler(
        data.val, num_replicas=d.world, rank=d.rank, shuffle=False
    )
    train_dl = DataLoader(data.train, batch_size=tc.batch_size, sampler=train_sampler, drop_last=True)
    val_dl = DataLoader(data.val, batch_size=tc.batch_size, sampler=val_sampler)
    steps_per_epoch = len(train_dl) // tc.grad_accum
    if tc.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, tc.max_steps_per_epoch)
    return Loaders(train_sampler, train_dl, val_dl, steps_per_epoch)
