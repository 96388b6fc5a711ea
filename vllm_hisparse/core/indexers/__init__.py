"""Indexers: what picks the units (pages or tokens) a sparse decode row attends, behind one
interface (``base.Indexer``), one folder per indexer, chosen by the config field ``indexer``.

The runtime, the decode batch and body, capacity and admission talk to ``base.Indexer`` only;
``get(cfg.indexer)`` gives the class. Both served paths look it up here: GQA models (the
runtime's decode body) and MLA models (vllm/mla_worker.py keeps the class, whose
``mla_selection`` the MLA backend asks every layer; vllm/mla_setup.py accepts the indexers whose
``serves`` is "mla"). Adding an indexer: a file (or folder) with a subclass and
one line: a built-in one in ``_PATHS`` and ``config.INDEXERS``, any other ``register(name, path,
unit)`` (tests/test_third_indexer.py serves a test-only one through vLLM that way).
"""
from __future__ import annotations

import importlib

from vllm_hisparse import config
from vllm_hisparse.core.indexers.base import Indexer

_PATHS = {
    "quest": "vllm_hisparse.core.indexers.quest.indexer:QuestIndexer",
    "dsa": "vllm_hisparse.core.indexers.dsa.indexer:DSAIndexer",
    "dsa_sorted": "vllm_hisparse.core.indexers.dsa.sorted:DSASortedIndexer",
    "dsa_stable": "vllm_hisparse.core.indexers.dsa.stable:DSAStableIndexer",
}
NAMES = tuple(_PATHS)


def register(name: str, path: str, unit: str) -> None:
    """Make ``name`` a choice of the config field ``indexer``: ``path`` ("module:Class") names a
    subclass of ``base.Indexer`` whose ``name`` is ``name``, ``unit`` its selection unit ("page":
    page_size tokens, "token": one). Every process that loads a config naming it must have
    registered it (a vLLM engine's processes: from a general plugin, or an in-process engine)."""
    if unit not in config.UNITS:
        raise ValueError(f"unit={unit!r}: choose one of {', '.join(config.UNITS)}")
    _PATHS[name] = path
    config.INDEXERS[name] = unit


def get(name: str) -> type[Indexer]:
    """The indexer class registered as ``name`` (the config field ``indexer``)."""
    path = _PATHS.get(name)
    if path is None:
        raise ValueError(f"indexer={name!r} is not known; set the hisparse config's indexer to one "
                         f"of {', '.join(_PATHS)}")
    mod, cls = path.split(":")
    return getattr(importlib.import_module(mod), cls)


def serving(kind: str) -> list[str]:
    """The registered names whose class serves ``kind`` ("gqa" or "mla": ``Indexer.serves``)."""
    return [name for name in _PATHS if get(name).serves == kind]


__all__ = ["Indexer", "NAMES", "get", "register", "serving"]
