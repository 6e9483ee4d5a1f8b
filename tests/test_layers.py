"""The package's import structure: each folder imports only the folders below it, and no module imports itself back.

Folders from the bottom: ``compat`` (torch internals), ``comm``, ``layout``, ``grad``, ``offload``,
``step``, ``reduce``, ``gather``, ``checkpoint``, the optimizer's own modules at the top level, then
``integrations``. Every import counts, those under ``TYPE_CHECKING`` and inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import zeroshard

ROOT = Path(zeroshard.__file__).parent
# zeroshard.kernels: a folder of the package when installed from the wheel, the repository's kernels/ in a source tree.
KERNELS = ROOT / "kernels" if (ROOT / "kernels").is_dir() else ROOT.parent / "kernels"
LAYERS = ["kernels", "compat", "comm", "layout", "grad", "offload", "step", "reduce", "gather", "checkpoint", "", "integrations"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts if path.is_relative_to(ROOT) else ("kernels", *path.relative_to(KERNELS).with_suffix("").parts)
    return ".".join(("zeroshard", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("zeroshard", *parts))


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every module of ``modules`` that ``path`` (module ``name``) imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("zeroshard"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])])
            if base.startswith("zeroshard"):
                submodules = {f"{base}.{a.name}" for a in node.names} & modules  # ``from package import module``
                found.update(submodules or {base})
    return {m for m in found if m != name and m in modules}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in [*ROOT.rglob("*.py"), *KERNELS.rglob("*.py")]}
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


def layer_of(module: str) -> int:
    parts = module.split(".")
    folder = parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else ""
    if len(parts) >= 2 and parts[1] in ("compat", "kernels"):
        folder = parts[1]
    return LAYERS.index(folder)


def test_no_module_imports_a_folder_above_its_own() -> None:
    upward = [f"{m} (layer {LAYERS[layer_of(m)] or 'top'}) imports {d} (layer {LAYERS[layer_of(d)] or 'top'})"
              for m, deps in graph().items() for d in deps if m != "zeroshard" and layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    edges = graph()
    edges["zeroshard"] = set()  # the package root re-exports the API; nothing imports it for code
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_folders_and_top_level_modules() -> None:
    edges = graph()
    assert "zeroshard.comm.collectives" in edges["zeroshard.comm.groups"]
    assert layer_of("zeroshard.optimizer") == LAYERS.index("") > layer_of("zeroshard.checkpoint.sharded") > layer_of("zeroshard.comm.groups")
    assert layer_of("zeroshard.compat") < layer_of("zeroshard.comm.collectives")
    assert layer_of("zeroshard.integrations.hf") == len(LAYERS) - 1
    assert layer_of("zeroshard.kernels.adam") == 0 and "zeroshard.kernels.adam" in edges
    assert "zeroshard.kernels" in edges["zeroshard.step.fused_adam"]


def test_no_module_over_25k_characters() -> None:
    """Every module stays within 25,000 characters: one that would grow past it is split along its concerns."""
    big = {str(p.relative_to(ROOT.parent)): n for p in [*ROOT.rglob("*.py"), *KERNELS.rglob("*.py")] if (n := len(p.read_text())) > 25_000}
    assert not big, big
