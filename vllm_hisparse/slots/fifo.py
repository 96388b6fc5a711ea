"""First in, first out: misses enter at the front in selection order; hits do not move. LRU's
state and eviction order (victims from the back), without LRU's move of hits to the front."""
from __future__ import annotations

from .base import StepInfo, reorder
from .lru import LRU


class FIFO(LRU):
    name = "fifo"
    kernel = None            # not served: no RESOLVE kernel branch
    kernel_state = None

    def update(self, state, info: StepInfo):
        order = state["order"]
        order[info.rows] = reorder(order[info.rows], info, hit_key=False, miss_key=True)
