"""The import graph of draftwise/ has no loops: between packages, and between modules.

The graph is read with `ast`, not by importing: every `import` and `from ... import` statement counts,
at module level, inside functions and under `if TYPE_CHECKING:` alike (an import inside a function is a
dependency all the same, only a late one). Relative imports are resolved against the importing module.

A *package* here is a subpackage of draftwise (engine, rules, drafters, models, ...) or one of its
top-level modules (api, plan, methods, ...); `draftwise/__init__.py` and `__main__.py`, which re-export
and start the command line, are the root and stand outside the graph.

Run it as a script to print the graph's loops and the package layers (`--edges`: each package edge and the imports
that make it):

    .venv/bin/python tests/test_layering.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "draftwise"
ROOT_MODULES = {"draftwise", "draftwise.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The draftwise module `name` stands for: itself, or its longest known prefix (an attribute of a module)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The draftwise modules `module` imports anywhere in its body (functions included)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub; `from mod import name` imports mod.
            targets = [f"{origin}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "draftwise":
                continue
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def module_graph() -> dict[str, set[str]]:
    """Each module's imports of other draftwise modules (the root left out)."""
    known = modules()
    return {
        name: {t for t in imports(name, path, known) if t not in ROOT_MODULES}
        for name, path in known.items() if name not in ROOT_MODULES
    }


def package_of(module: str) -> str:
    return module.split(".")[1]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets if package_of(t) != package_of(module))
    return packages


def package_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Each package edge with the module imports that make it."""
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if package_of(target) != package_of(module):
                edges.setdefault((package_of(module), package_of(target)), []).append((module, target))
    return edges


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every elementary loop (Johnson's search, small graphs), as its smallest rotation."""
    found: set[tuple[str, ...]] = set()
    for component in components(graph):
        members = set(component)
        for start in component:
            # Loops through `start` whose other nodes all sort after it: each loop is found once, from its smallest node.
            path = [start]
            work = [iter(sorted(t for t in graph[start] if t in members and t >= start))]
            while work:
                child = next(work[-1], None)
                if child is None:
                    work.pop()
                    path.pop()
                elif child == start:
                    found.add(tuple(path))
                elif child not in path:
                    path.append(child)
                    work.append(iter(sorted(t for t in graph[child] if t in members and t >= start)))
    return found


def test_the_reader_sees_imports_in_functions_and_relative_imports(tmp_path, monkeypatch):
    """The reader is not blind: a loop closed inside a function, through a relative import, is a loop."""
    pkg = tmp_path / "draftwise"
    (pkg / "alpha").mkdir(parents=True)
    (pkg / "beta").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "alpha" / "__init__.py").write_text("")
    (pkg / "beta" / "__init__.py").write_text("")
    (pkg / "alpha" / "one.py").write_text("from draftwise.beta.two import thing\n")
    (pkg / "beta" / "two.py").write_text("def thing():\n    from ..alpha import one\n    return one\n")
    (pkg / "gamma.py").write_text("import draftwise.alpha.one\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = module_graph()
    assert graph["draftwise.beta.two"] == {"draftwise.alpha.one"}
    assert graph["draftwise.gamma"] == {"draftwise.alpha.one"}
    assert cycles(graph) == {("draftwise.alpha.one", "draftwise.beta.two")}
    assert cycles(package_graph(graph)) == {("alpha", "beta")}


def test_packages_form_a_dag():
    graph = module_graph()
    edges = package_edges(graph)
    loops = sorted(cycles(package_graph(graph)))
    described = [" -> ".join(loop + (loop[0],)) + "  via "
                 + "; ".join(f"{a} -> {b}" for x, y in zip(loop, loop[1:] + (loop[0],)) for a, b in edges[x, y][:3])
                 for loop in loops]
    assert not loops, "package loops:\n" + "\n".join(described)


def test_modules_form_a_dag():
    loops = sorted(cycles(module_graph()))
    assert not loops, "module loops:\n" + "\n".join(" -> ".join(loop + (loop[0],)) for loop in loops)


def code_map() -> dict[str, str]:
    """docs/architecture.md's code map (section 6) as text per package: "" for the top-level modules."""
    import re

    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## 6. Where the pieces live", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    current: list[str] = []
    for line in block.splitlines()[2:]:  # after "draftwise/"
        entry = re.match(r"^  (\S.*?)(?:\s{2,}|$)", line)
        if entry:
            names = re.findall(r"(\w+)/", entry.group(1))
            current = names if names else [""]
        for name in current:
            sections[name] = sections.get(name, "") + line + "\n"
    return sections


def test_the_code_map_names_every_module():
    """Every module of every package, and every folder inside one, is named in its package's part of the map."""
    sections = code_map()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if path.name in ("__init__.py", "__main__.py") or "csrc" in parts:
            continue
        section, name = ("", parts[0]) if len(parts) == 1 else (parts[0], parts[1] if len(parts) == 2 else parts[1] + "/")
        if name not in sections.get(section, ""):
            missing.append("/".join(parts[:2]))
    assert not missing, f"docs/architecture.md's code map does not name: {', '.join(sorted(set(missing)))}"


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """The nodes of a DAG by level: each node one above the highest node it imports (level 0 imports none)."""
    level: dict[str, int] = {}

    def of(node: str, seen: tuple[str, ...] = ()) -> int:
        if node not in level:
            if node in seen:
                raise ValueError(f"a loop through {node}")
            level[node] = 1 + max((of(t, seen + (node,)) for t in graph.get(node, ())), default=-1)
        return level[node]

    for node in graph:
        of(node)
    return [sorted(n for n in graph if level[n] == k) for k in range(max(level.values(), default=-1) + 1)]


def main() -> None:
    graph = module_graph()
    packages = package_graph(graph)
    edges = package_edges(graph)
    internal = sum(len(t) for t in graph.values())
    print(f"{len(graph)} modules, {internal} module edges, {len(packages)} packages")
    for loop in sorted(cycles(packages), key=len):
        print("package loop:", " -> ".join(loop + (loop[0],)))
        for x, y in zip(loop, loop[1:] + (loop[0],)):
            for a, b in edges[x, y]:
                print(f"    {a} -> {b}")
    for loop in sorted(cycles(graph), key=len):
        print("module loop:", " -> ".join(loop + (loop[0],)))
    if not cycles(packages):
        print("package layers (each imports only packages below it):")
        for k, level in enumerate(layers(packages)):
            print(f"  {k}: {' '.join(level)}")
    if "--edges" in sys.argv:
        for (a, b), via in sorted(edges.items()):
            print(f"{a} -> {b}: " + ", ".join(f"{x.split('.', 1)[1]}>{y.split('.', 1)[1]}" for x, y in via))


if __name__ == "__main__":
    main()
