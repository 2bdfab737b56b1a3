"""Progress bar and timing around weight loading."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from tokenmill.loader.source import ModelSource

logger = logging.getLogger("tokenmill.loader")


def iter_with_progress(
    source: ModelSource, disable: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``source.iter_weights()`` unchanged, under a "Loading weights" tqdm bar.

    When the iteration is exhausted, logs (logger ``tokenmill.loader``, INFO) how many tensors were
    loaded and how many seconds it took, consumer time included. ``disable`` is passed to tqdm
    (``None`` hides the bar when stderr is not a terminal).
    """
    start = time.perf_counter()
    count = 0
    with tqdm(
        total=source.num_weight_tensors(), desc="Loading weights", unit="tensor", disable=disable
    ) as bar:
        for item in source.iter_weights():
            yield item
            count += 1
            bar.update(1)
    logger.info("loaded %d weight tensors of %s in %.2f s", count, source.name, time.perf_counter() - start)
