"""The KV connector's step metadata: what the scheduler half (vllm/connector_scheduler.py) tells
every worker's half (vllm/connector_worker.py) each step, before the step's forward."""
from __future__ import annotations

from dataclasses import dataclass, field

from .compat import KVConnectorMetadata


@dataclass
class HiSparseConnectorMetadata(KVConnectorMetadata):
    new: dict[str, tuple[int, int]] = field(default_factory=dict)   # req -> (prompt len, block 0)
    finished: list[str] = field(default_factory=list)   # dropped before ``new`` takes their rows
    # dropped like ``finished`` but never reported in finished_sending: vLLM freed their blocks
    # at once (never sparse: no host page, no indexer row) and has forgotten them
    freed: list[str] = field(default_factory=list)
    spilled: dict[str, int] = field(default_factory=dict)  # resident_first: req -> its new keep
    hostless: list[str] = field(default_factory=list)  # of ``new``: no host copy, all on the GPU
    hosted: list[str] = field(default_factory=list)    # host-less until now: host pages, a row
    # of ``new`` and ``hosted``: req -> (host page ids of its whole life, shared_upto: its first
    # pages shared with others, complete, never written by it): core/host_pages.py
    pages: dict[str, tuple[list[int], int]] = field(default_factory=dict)
