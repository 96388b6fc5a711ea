"""Indexers: what picks the units (pages or tokens) a sparse decode row attends, behind one
interface (``base.Indexer``), one folder per indexer, chosen by the config field ``indexer``.

The runtime, the decode batch and body, capacity and admission talk to ``base.Indexer`` only;
``get(cfg.indexer)`` gives the class. Adding an indexer: a folder here with a subclass, a line in
``_PATHS`` and its name in ``config.INDEXERS``.
"""
from __future__ import annotations

import importlib

from vllm_hisparse.core.indexers.base import Indexer

_PATHS = {
    "quest": "vllm_hisparse.core.indexers.quest.indexer:QuestIndexer",
    "dsa": "vllm_hisparse.core.indexers.dsa.indexer:DSAIndexer",
}
NAMES = tuple(_PATHS)


def get(name: str) -> type[Indexer]:
    """The indexer class registered as ``name`` (the config field ``indexer``)."""
    path = _PATHS.get(name)
    if path is None:
        raise ValueError(f"indexer={name!r} is not known; set the hisparse config's indexer to one "
                         f"of {', '.join(NAMES)}")
    mod, cls = path.split(":")
    return getattr(importlib.import_module(mod), cls)


__all__ = ["Indexer", "NAMES", "get"]
