"""One JSON line per engine step, for the serving benchmark (bench/serving.py, bench/steps.py).

A vLLM stat logger plugin (entry point group ``vllm.stat_logger_plugins``, vLLM's documented
extension point; ``vllm serve``'s front end loads it and calls ``record`` once per engine step with
that step's scheduler and iteration stats, in order). With ``HISPARSE_STEP_LOG=path`` set in the
server's environment it appends one line per step to ``path``; without it, it writes nothing. Its
presence makes vLLM keep its per-step stats even under ``--disable-log-stats`` (vLLM turns stats on
for any custom logger): the only effect on a run that does not set the variable.

Per step: ``t`` (the front end's monotonic clock when it recorded the step), ``gen`` (tokens
generated), ``first`` (requests that got their first token: a prefill completed), ``prompt``
(their prompt tokens), ``finished``, ``preempted``, ``itl`` (the median time since each decoding
request's previous token, measured on the engine's clock, ``None`` when no request decoded: in a
step where every request decodes, the step's own duration), ``running`` and ``waiting`` (the
scheduler's queues after the step; ``None`` when vLLM sent no scheduler stats).
"""
from __future__ import annotations

import json
import os
import statistics
import time

from .compat import StatLoggerBase

STEP_LOG_ENV = "HISPARSE_STEP_LOG"


class StepLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        path = os.environ.get(STEP_LOG_ENV)
        self._f = open(path, "a", buffering=1) if path else None     # a line per write
        self.engine_index = engine_index

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if self._f is None or (scheduler_stats is None and iteration_stats is None):
            return
        self._f.write(json.dumps(step_record(scheduler_stats, iteration_stats)) + "\n")

    def log_engine_initialized(self):
        pass


def step_record(scheduler_stats, iteration_stats, now: float | None = None) -> dict:
    """The record of one step from vLLM's SchedulerStats and IterationStats (either may be None:
    a step with no request output sends no iteration stats)."""
    it, sc = iteration_stats, scheduler_stats
    itl = list(it.inter_token_latencies_iter) if it is not None else []
    return {
        "t": time.monotonic() if now is None else now,
        "gen": it.num_generation_tokens if it is not None else 0,
        "first": len(it.time_to_first_tokens_iter) if it is not None else 0,
        "prompt": it.num_prompt_tokens if it is not None else 0,
        "finished": len(it.finished_requests) if it is not None else 0,
        "preempted": it.num_preempted_reqs if it is not None else 0,
        "itl": statistics.median(itl) if itl else None,
        "running": sc.num_running_reqs if sc is not None else None,
        "waiting": sc.num_waiting_reqs if sc is not None else None,
    }
