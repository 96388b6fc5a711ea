"""The core, ops and sim packages never import vLLM (checked in a fresh interpreter), and no
module imports a part of the package above its own (read from the source)."""
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
    "knobs": set(), "server_health": set(), "smollm2": set(), "tiny_model": set(), "_C": set(),
    "slots": {"knobs"},
    "config": {"slots", "knobs"},
    "ops": {"slots", "knobs", "_C"},
    "core": {"slots", "knobs", "config", "ops"},
    "sim": {"slots", "knobs", "config", "ops", "smollm2", "tiny_model"},
    "vllm": {"slots", "knobs", "config", "ops", "core", "sim"},
    "bench": {"slots", "knobs", "config", "ops", "core", "sim", "vllm", "server_health",
              "smollm2", "tiny_model"},
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
