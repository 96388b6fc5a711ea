"""The adapter keeps no mutable module state (issue 44 item 2): each worker process's state lives in
one worker object (vllm/worker.py), and the FULL decode step's plan and run are two methods of it.

The first test reads every module of ``vllm_hisparse/vllm/`` (no vLLM needed): no ``global``
statement, and nothing bound at module level but constants (UPPER_CASE names bound to immutable
values), functions, classes, imports and the logger."""
from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import pytest

ADAPTER = pathlib.Path(__file__).resolve().parent.parent / "vllm_hisparse" / "vllm"
MUTABLE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary",
                 "WeakValueDictionary", "WeakSet", "deque", "Counter"}


def _module_state(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    bad = [f"{path.name}:{n.lineno} global {', '.join(n.names)}"
           for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        names = [t.id for t in flat if isinstance(t, ast.Name)]
        if len(names) != len(flat):
            bad.append(f"{path.name}:{node.lineno} binds something other than a name")
            continue
        call = value.func if isinstance(value, ast.Call) else None
        mutable = isinstance(value, MUTABLE) or (
            call is not None and getattr(call, "id", getattr(call, "attr", None)) in MUTABLE_CALLS)
        for name in names:
            if name == "__all__":                 # the export list, read by tools only
                continue
            if mutable or not (name.isupper() or name == "logger"):
                bad.append(f"{path.name}:{node.lineno} {name}")
    return bad


def test_no_mutable_module_global_in_the_adapter():
    files = sorted(ADAPTER.glob("*.py"))
    assert len(files) > 10
    bad = [b for f in files for b in _module_state(f)]
    assert bad == [], "module state in vllm_hisparse/vllm/ (keep it on the worker object): " + \
        "; ".join(bad)


def test_the_check_sees_module_state(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("X = 1\nNAMES = ('a',)\nlogger = None\ncache = None\n_SEEN = {}\n"
                 "A, b = 1, 2\ndef f():\n    global cache\n    cache = 1\n")
    assert _module_state(p) == ["m.py:8 global cache", "m.py:4 cache", "m.py:5 _SEEN", "m.py:6 b"]


class _Runtime:
    def __init__(self):
        self.full = []

    def plan_full(self, ids, seq_lens, n, block_table=None):
        self.full.append((list(ids), list(seq_lens), n))

    def full_layer(self, layer, n, *args):
        self.full.append(("layer", layer, n))


def _md(first_blocks, seq_lens, full, rows):
    return SimpleNamespace(full=full, full_rows=rows, first_blocks=first_blocks,
                           seq_lens=seq_lens, block_table=None, pending=False)


def test_full_step_is_noted_planned_once_then_run_per_layer():
    """note (builder) -> plan (connector start_load_kv, requests bound) -> run per layer: one
    plan_full per step whoever plans first; a noted step forgotten (a dummy run that never reached
    start_load_kv) is not planned by a later hook; a batch of no live request plans padding."""
    pytest.importorskip("vllm")
    from vllm_hisparse.vllm.gqa_worker import HiSparseWorker

    w = HiSparseWorker(dep=None)
    w.runtime = rt = _Runtime()
    w.rows.bind("a", 7)
    w.rows.bind("b", 9)
    md = _md([9, 7, -1, -1], [40, 33, 0, 0], full=4, rows=2)
    w.note(md)
    assert md.pending and rt.full == []
    w.plan()                                              # start_load_kv
    w.run(0, md, None, None, None, None, 1.0, None)       # each layer: no second plan
    w.run(1, md, None, None, None, None, 1.0, None)
    assert rt.full == [(["b", "a"], [40, 33], 4), ("layer", 0, 4), ("layer", 1, 4)]
    rt.full.clear()
    md2 = _md([9], [41], full=1, rows=1)                  # a run without start_load_kv
    w.note(md2)
    w.run(0, md2, None, None, None, None, 1.0, None)
    assert rt.full == [(["b"], [41], 1), ("layer", 0, 1)]
    rt.full.clear()
    w.note(_md([5], [3], full=1, rows=1))                 # noted by a dummy run, then forgotten
    w.forget()
    w.plan()
    assert rt.full == []
    w.note(_md([5, -1], [3, 0], full=2, rows=1))          # block 5 belongs to no live request
    w.plan()
    assert rt.full == [([], [], 2)]
