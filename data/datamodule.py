"""The LightningDataModule: windows of block_size + 1 tokens from a prepared corpus (data.prepare)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler

from data.cache import TokenCache
from data.prepare import check_sizes, prepare_corpus, tokens_per_char

log = logging.getLogger(__name__)


class RandomWindows(Dataset):
    """Item i is a whole batch: batch_size windows at offsets drawn from a generator seeded with
    (seed, i). The data order is a pure function of the seed and the batch index, so a run can
    restart at any batch and see exactly what it would have seen.

    `encodings`: the training split's ids, or several encodings of it (as the tokenizer encodes it, then
    with BPE-dropout: TokenCache.train_encodings); each window then comes from one drawn at random."""

    def __init__(
        self, encodings: np.ndarray | list[np.ndarray], block_size: int, batch_size: int, seed: int, num_batches: int
    ):
        self.encodings = [encodings] if isinstance(encodings, np.ndarray) else list(encodings)
        self.block_size, self.batch_size = block_size, batch_size
        self.seed, self.num_batches = seed, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, index))
        if len(self.encodings) == 1:
            ids = self.encodings[0]
            starts = rng.integers(0, len(ids) - self.block_size, size=self.batch_size)
            rows = [ids[s : s + self.block_size + 1] for s in starts]
        else:
            which = rng.integers(0, len(self.encodings), size=self.batch_size)
            places = rng.random(size=self.batch_size)  # where in its encoding, as a share of the starts it has
            rows = []
            for n, place in zip(which, places, strict=True):
                ids = self.encodings[n]
                start = int(place * (len(ids) - self.block_size))
                rows.append(ids[start : start + self.block_size + 1])
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]  # inputs and targets, shifted by one


class StepSampler(Sampler[int]):
    """Batch indices for one process: its k-th micro-batch is batch k * world_size + rank.

    Together the processes draw batches 0, 1, 2, ... exactly once, in the order a single process
    would, so a run's data does not depend on how many devices share it. Iteration starts at
    k = start(), read when iteration begins, so a resumed run goes on with the first batch it has
    not trained on. The length stays the whole run's: Lightning counts the batches it restored.
    """

    def __init__(self, num_batches: int, rank: int = 0, world_size: int = 1, start: Callable[[], int] = lambda: 0):
        self.num_batches, self.rank, self.world_size, self.start = num_batches, rank, world_size, start

    def __iter__(self):
        return (k * self.world_size + self.rank for k in range(self.start(), self.num_batches))

    def __len__(self) -> int:
        return self.num_batches


class ContiguousWindows(Dataset):
    """Non-overlapping windows that cover the split in order: every token but the first is a target once."""

    def __init__(self, ids: np.ndarray, block_size: int):
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = torch.from_numpy(self.ids[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


class TextDataModule(L.LightningDataModule):
    """Serves windows of block_size + 1 tokens from a prepared corpus (see prepare_corpus).

    `prepare()` may be called before the model exists: the model needs `vocab_size`. Given a `cache`
    (prepared already), it prepares nothing. `num_batches`: micro-batches each process draws in the
    whole run; `world_size` processes share the data order (see StepSampler), `accumulation`
    micro-batches make one optimizer step.
    """

    def __init__(
        self,
        data_cfg,
        tokenizer_cfg,
        block_size: int,
        seed: int,
        num_batches: int,
        tokenizer: Tokenizer | None = None,
        progress: Callable[[dict], None] | None = None,
        *,
        cache: TokenCache | None = None,
        accumulation: int = 1,
        world_size: int = 1,
    ):
        super().__init__()
        self.data_cfg, self.tokenizer_cfg, self.given_tokenizer = data_cfg, tokenizer_cfg, tokenizer
        self.block_size, self.seed, self.num_batches = block_size, seed, num_batches
        self.batch_size = data_cfg.batch_size
        self.progress = progress
        self.cache = cache
        self.accumulation, self.world_size = accumulation, world_size

    # ---- preparation -----------------------------------------------------------------------------

    def prepare(self) -> TokenCache:
        """Find the text and tokenize it, unless the cache already holds the result."""
        if self.cache is None:
            cache = prepare_corpus(self.data_cfg, self.tokenizer_cfg, self.given_tokenizer, self.progress)
            check_sizes(cache, self.block_size, self.data_cfg)
            self.cache = cache
        return self.cache

    def prepare_data(self) -> None:
        self.prepare()

    def setup(self, stage: str | None = None) -> None:
        self.prepare()

    # ---- what the model and the logs need --------------------------------------------------------

    @property
    def source(self) -> str:
        """Where the text came from, for logs."""
        return self.prepare().meta["source"]

    @property
    def tokenizer_json(self) -> str:
        return self.prepare().tokenizer_json

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.tokenizer_json)

    @property
    def vocab_size(self) -> int:
        return self.prepare().meta["vocab_size"]

    @property
    def val_tokens_per_char(self) -> float:
        """Converts a mean loss per token into one per character (for bits per character)."""
        return tokens_per_char(self.prepare())

    # ---- loaders ---------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        windows = RandomWindows(
            self.prepare().train_encodings(),
            self.block_size,
            self.batch_size,
            self.seed,
            self.num_batches * self.world_size,
        )
        trainer = self.trainer
        if trainer is None:
            return self.loader(windows, batch_size=None)
        sampler = StepSampler(
            self.num_batches,
            trainer.global_rank,
            self.world_size,
            start=lambda: trainer.global_step * self.accumulation,  # batches already trained on (resumed runs)
        )
        return self.loader(windows, batch_size=None, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        windows = ContiguousWindows(self.prepare().ids("val"), self.block_size)
        trainer = self.trainer
        shard = None
        if trainer is not None and self.world_size > 1:  # each process scores every world_size-th window
            shard = list(range(trainer.global_rank, len(windows), self.world_size))
        return self.loader(windows, batch_size=self.batch_size, sampler=shard)

    def loader(self, dataset: Dataset, batch_size: int | None, sampler=None) -> DataLoader:
        workers = self.data_cfg.get("num_workers", 0)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            shuffle=False,
            generator=torch.Generator(),  # creating an iterator draws a seed: not from the global RNG
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=workers > 0,
        )


def batches_for(max_steps: int, accumulate: int) -> int:
    """Training batches a run will draw; unbounded (max_steps=-1, e.g. time-limited runs) gets a huge count."""
    return max_steps * accumulate if max_steps and max_steps > 0 else 2**40 - 1
