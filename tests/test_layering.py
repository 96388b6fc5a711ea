"""The core, ops and sim packages never import vLLM (checked in a fresh interpreter), no module
imports a part of the package above its own, every package has a layer, and no module's imports
lead back to it (all read from the source)."""
import ast
import pathlib
import subprocess
import sys

import vllm_hisparse


def test_core_ops_sim_do_not_import_vllm():
    code = ("import sys, importlib, pkgutil, vllm_hisparse\n"
            "import vllm_hisparse.config, vllm_hisparse.core, vllm_hisparse.ops, vllm_hisparse.sim\n"
            "for pkg in (vllm_hisparse.core, vllm_hisparse.ops, vllm_hisparse.sim):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


# What each part of the package may import of the package (besides itself), bottom up: an import
# running up the layers fails here. Root modules other than these are entry points (cli, demo).
MAY_IMPORT = {
    "knobs": set(), "server_health": set(), "model_dir": set(), "smollm2": {"model_dir"},
    "tiny_model": {"model_dir"}, "_C": set(),
    "slots": {"knobs"},
    "config": {"slots", "knobs"},
    "ops": {"slots", "knobs", "_C"},
    "core": {"slots", "knobs", "config", "ops"},
    "sim": {"slots", "knobs", "config", "ops", "smollm2", "tiny_model", "model_dir"},
    "vllm": {"slots", "knobs", "config", "ops", "core", "sim"},
    "bench": {"slots", "knobs", "config", "ops", "core", "sim", "vllm", "server_health",
              "smollm2", "tiny_model", "model_dir"},
}


def _imports_of(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    """The package parts (the first name under vllm_hisparse) a module imports, relative imports
    resolved against its own package."""
    pkg = path.relative_to(root.parent).parent.parts            # ('vllm_hisparse', 'ops')
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [(tuple(a.name.split(".")), []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else ()
            mod = base + (tuple(node.module.split(".")) if node.module else ())
            targets = [(mod, [a.name for a in node.names])]
        else:
            continue
        for mod, names in targets:
            if mod[:1] != ("vllm_hisparse",):
                continue
            found.update(mod[1:2] if len(mod) > 1 else names)   # from vllm_hisparse import X
    return found


def test_no_import_runs_up_the_layers():
    root = pathlib.Path(vllm_hisparse.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        part = path.relative_to(root).parts[0].removesuffix(".py")
        if part not in MAY_IMPORT:
            continue                                  # entry points: cli, demo, __init__
        for dep in sorted(_imports_of(path, root) - {part} - MAY_IMPORT[part]):
            bad.append(f"{path.relative_to(root.parent)} imports vllm_hisparse.{dep}")
    assert not bad, "\n".join(bad)


def test_every_package_has_a_layer():
    """A new package under vllm_hisparse gets a row in MAY_IMPORT (else the test above skips it)."""
    root = pathlib.Path(vllm_hisparse.__file__).parent
    new = sorted(p.parent.name for p in root.glob("*/__init__.py")
                 if p.parent.name not in MAY_IMPORT)
    assert not new, f"packages without a layer in MAY_IMPORT: {new}"


def _module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, dotted names (a package is its __init__). Every
    import statement counts, at module level or inside a function: a function's import runs the
    other module (and whatever it imports) as surely, only later, and a circle closed that way
    still ties the two modules together; the two circles this test was written for were closed
    inside functions. ``from pkg import name`` is an edge to pkg.name where that is a module, to
    pkg otherwise. A module's implicit import of its own package (Python runs the package's
    __init__ first) is not an edge unless written."""
    mods = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                up = pkg.split(".")
                base = ".".join(up[:len(up) - node.level + 1]) if node.level else ""
                mod = ".".join(p for p in (base, node.module or "") if p)
                deps.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else known(mod)
                            for a in node.names)
        graph[name] = {d for d in deps if d and d != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles (a -> b -> ... -> a) found by depth-first search: none exactly when the graph has
    none, at least one in each group of modules that reach each other."""
    seen, found = set(), []

    def visit(v, path, on_path):
        for w in sorted(graph.get(v, ())):
            if w in on_path:
                found.append(path[path.index(w):] + [w])
            elif w not in seen:
                seen.add(w)
                visit(w, path + [w], on_path | {w})

    for v in sorted(graph):
        if v not in seen:
            seen.add(v)
            visit(v, [v], {v})
    return found


def test_circle_finder_sees_a_circle_closed_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .b import X\n")
    (pkg / "sub" / "b.py").write_text("X = 1\n\ndef f():\n    from pkg.sub import a\n")
    (pkg / "c.py").write_text("from .sub import b\n")
    assert [set(c) for c in _circles(_module_graph(pkg))] == [{"pkg.sub.a", "pkg.sub.b"}]


def test_no_import_circle():
    """No module of vllm_hisparse reaches itself through the package's imports (see _module_graph
    for what counts)."""
    circles = _circles(_module_graph(pathlib.Path(vllm_hisparse.__file__).parent))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
