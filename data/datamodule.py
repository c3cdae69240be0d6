"""The LightningDataModule: text -> tokenizer -> cached token ids -> windows of block_size + 1."""

from __future__ import annotations

import logging

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler

from .cache import TokenCache, build_cache, find_cache, fingerprint
from .sources import DataError, load_splits
from .tokenizer import build_tokenizer, eot_id

log = logging.getLogger(__name__)


class RandomWindows(Dataset):
    """Item i is a whole batch: batch_size windows at offsets drawn from a generator seeded with
    (seed, i). The data order is a pure function of the seed and the batch index, so a run can
    restart at any batch and see exactly what it would have seen."""

    def __init__(self, ids: np.ndarray, block_size: int, batch_size: int, seed: int, num_batches: int):
        self.ids, self.block_size, self.batch_size = ids, block_size, batch_size
        self.seed, self.num_batches = seed, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, index))
        starts = rng.integers(0, len(self.ids) - self.block_size, size=self.batch_size)
        windows = torch.from_numpy(np.stack([self.ids[s : s + self.block_size + 1] for s in starts]).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]  # inputs and targets, shifted by one


class StepSampler(Sampler[int]):
    """Batch indices for one process: its k-th micro-batch is batch k * world_size + rank, from
    k = start. Together the processes draw batches 0, 1, 2, ... exactly once, in the order a single
    process would, so a run's data does not depend on how many devices share it."""

    def __init__(self, num_batches: int, rank: int = 0, world_size: int = 1, start: int = 0):
        self.num_batches, self.rank, self.world_size, self.start = num_batches, rank, world_size, start

    def __iter__(self):
        return (k * self.world_size + self.rank for k in range(self.start, self.num_batches))

    def __len__(self) -> int:
        return max(0, self.num_batches - self.start)


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
    """Prepares a corpus once (tokenizer + token ids in the cache) and serves windows from it.

    `prepare()` may be called before the model exists: the model needs `vocab_size`. A ready
    `tokenizer` (e.g. the one of a checkpoint being fine-tuned) is used as it is, instead of one
    built from `tokenizer_cfg`.
    """

    def __init__(
        self, data_cfg, tokenizer_cfg, block_size: int, seed: int, num_batches: int, tokenizer: Tokenizer | None = None
    ):
        super().__init__()
        self.data_cfg, self.tokenizer_cfg, self.given_tokenizer = data_cfg, tokenizer_cfg, tokenizer
        self.block_size, self.seed, self.num_batches = block_size, seed, num_batches
        self.batch_size = data_cfg.batch_size
        self.cache: TokenCache | None = None
        self.source: str | None = None

    # ---- preparation -----------------------------------------------------------------------------

    def prepare(self) -> TokenCache:
        """Load the text, train the tokenizer and tokenize, unless the cache already holds the result."""
        if self.cache is not None:
            return self.cache
        splits = load_splits(self.data_cfg)
        self.source = splits.source
        texts = {"train": splits.train, "val": splits.val}
        if self.given_tokenizer is not None:
            settings = {"tokenizer": {"given": self.given_tokenizer.to_str()}}
        else:
            settings = {"tokenizer": dict(self.tokenizer_cfg)}
        key = fingerprint(texts, settings)
        cache = find_cache(self.data_cfg.cache_dir, key)
        if cache is None:
            log.info("tokenizing %s (%d characters); later runs reuse the result", splits.source, sum(map(len, splits.train)) + splits.val_chars)
            tokenizer = self.given_tokenizer or build_tokenizer(self.tokenizer_cfg, splits.train)
            cache = build_cache(self.data_cfg.cache_dir, key, tokenizer, texts, eot_id(tokenizer))
        else:
            log.info("using cached tokens of %s from %s", splits.source, cache.folder)
        self.check_sizes(cache)
        self.cache = cache
        return cache

    def check_sizes(self, cache: TokenCache) -> None:
        need = self.block_size + 1
        for split in ("train", "val"):
            have = cache.meta[f"{split}_tokens"]
            if have < need:
                raise DataError(
                    f"the {split} split has {have} tokens, fewer than block_size + 1 = {need}; use more text, "
                    f"a larger data.val_fraction, or a smaller model.block_size"
                )

    def prepare_data(self) -> None:
        self.prepare()

    def setup(self, stage: str | None = None) -> None:
        self.prepare()

    # ---- what the model and the logs need --------------------------------------------------------

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
        meta = self.prepare().meta
        return meta["val_tokens"] / max(1, meta["val_chars"])

    # ---- loaders ---------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        windows = RandomWindows(self.prepare().ids("train"), self.block_size, self.batch_size, self.seed, self.num_batches)
        trainer = self.trainer
        if trainer is None:
            return self.loader(windows, batch_size=None)
        accumulate = trainer.accumulate_grad_batches
        per_process = batches_for(trainer.max_steps, accumulate)
        start = trainer.global_step * accumulate  # batches each process already drew (resuming)
        sampler = StepSampler(per_process, trainer.global_rank, trainer.world_size, start)
        return self.loader(windows, batch_size=None, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        windows = ContiguousWindows(self.prepare().ids("val"), self.block_size)
        trainer = self.trainer
        shard = None
        if trainer is not None and trainer.world_size > 1:  # each process scores every world_size-th window
            shard = list(range(trainer.global_rank, len(windows), trainer.world_size))
        return self.loader(windows, batch_size=self.batch_size, sampler=shard)

    def loader(self, dataset: Dataset, batch_size: int | None, sampler=None) -> DataLoader:
        workers = self.data_cfg.get("num_workers", 0)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            shuffle=False,
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=workers > 0,
        )


def batches_for(max_steps: int, accumulate: int) -> int:
    """Training batches a run will draw; unbounded (max_steps=-1, e.g. time-limited runs) gets a huge count."""
    return max_steps * accumulate if max_steps and max_steps > 0 else 2**40 - 1

