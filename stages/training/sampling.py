"""Index-addressed sampling of training examples.

A batch is a pure function of its global index, so a checkpoint's batch index is
the whole data position and the data seen does not depend on the process layout.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from crawl2chat.stages.training.settings import TrainConfig


class ExampleSampler:
    """Micro-batches of examples addressed by global batch index.

    Global batch ``i`` takes positions ``i*G .. i*G+G-1`` of an endless stream
    that visits the training examples in a fresh seeded permutation each
    epoch (``G`` = micro batch x accumulation x processes); its rows are dealt
    to (micro step, rank) pairs, so the data seen does not depend on the
    process layout and a checkpoint's batch index is the whole data position."""

    def __init__(self, n_train: int, eval_ids: list[int], collate: Callable[[list[int]], dict[str, torch.Tensor]],
                 cfg: TrainConfig, train_ids: list[int] | None = None):
        self.train_ids = train_ids if train_ids is not None else list(range(n_train))
        if not self.train_ids:
            raise ValueError("no training examples")
        self.eval_ids, self.collate, self.cfg = eval_ids, collate, cfg
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.train_ids))}
        return self._perms[epoch]

    def ids(self, batch_index: int, micro: int, rank: int, world: int) -> list[int]:
        c, n = self.cfg, len(self.train_ids)
        G = c.micro_batch_size * c.grad_accum * world
        first = batch_index * G + (micro * world + rank) * c.micro_batch_size
        return [self.train_ids[int(self._perm(p // n)[p % n])] for p in range(first, first + c.micro_batch_size)]

    def batch(self, batch_index: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        return self.collate(self.ids(batch_index, micro, rank, world))

    def eval_batches(self, rank: int, world: int):
        c = self.cfg
        mine = self.eval_ids[: c.eval_batches * c.micro_batch_size][rank::world]
        for i in range(0, len(mine), c.micro_batch_size):
            yield self.collate(mine[i:i + c.micro_batch_size])
