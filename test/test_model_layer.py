"""The model-neutral layer, checked as the next engineer would read it: model kinds are named only by the
registry and each model's own package; the ROS shell imports no model package; no model package imports
another (a shared backbone package such as `paligemma` is fine); `flashrt_core` has no import circle and never
imports the benchmark harness."""
import ast
import pathlib
import re

from flashrt_core.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = tuple(registry.MODELS)
SHARED = {"paligemma"}  # backbone packages several models share


def sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def owner(path: pathlib.Path) -> str | None:
    """The model package a file belongs to (None outside one)."""
    rel = path.relative_to(ROOT).parts
    return rel[2] if rel[:2] == ("flashrt_core", "models") and len(rel) > 3 else None


def test_kind_strings_live_in_the_registry_and_each_models_own_package():
    pattern = re.compile(r"""["'](%s)["']""" % "|".join(map(re.escape, KINDS)))
    found = []
    for package in ("flashrt_core", "flashrt_ros"):
        for path in sources(package):
            if path.name == "registry.py" or owner(path) in KINDS:
                continue
            found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in pattern.finditer(path.read_text())]
    assert not found, "model kinds named outside the registry and their packages:\n" + "\n".join(found)


def test_the_ros_shell_imports_no_model_package():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in sources("flashrt_ros") for m in imports(p)
           if any(m == f"flashrt_core.models.{k}" or m.startswith(f"flashrt_core.models.{k}.") for k in KINDS)]
    assert not bad, "\n".join(bad)


def test_no_model_package_imports_another():
    bad = []
    for path in sources("flashrt_core/models"):
        mine = owner(path)
        for m in imports(path):
            parts = m.split(".")
            other = parts[2] if parts[:2] == ["flashrt_core", "models"] and len(parts) > 2 else None
            if other in KINDS and other != mine:
                bad.append(f"{path.relative_to(ROOT)}: {m}")
            if mine in SHARED and other in KINDS:  # a shared backbone reads its members through the registry
                bad.append(f"{path.relative_to(ROOT)}: {m}")
    assert not bad, "\n".join(bad)


def test_the_core_has_no_import_circle_and_no_benchmark_harness():
    graph = {}
    for path in sources("flashrt_core"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        graph[name] = {m for m in imports(path) if m.startswith("flashrt_core")}
        assert not any(m.startswith("flashrt_bench") for m in imports(path)), f"{name} imports the harness"
    # module-level edges only between modules (a "pkg.mod.attr" import names the module "pkg.mod")
    edges = {n: {m if m in graph else m.rpartition(".")[0] for m in deps} & set(graph) - {n}
             for n, deps in graph.items()}
    state, cycle = {}, []

    def visit(n, stack):
        state[n] = 1
        for m in edges[n]:
            if state.get(m) == 1 and not m.startswith(n + ".") and not n.startswith(m + "."):
                cycle.append(stack + [n, m])
            elif m not in state:
                visit(m, stack + [n])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [])
    assert not cycle, "import circles: " + "; ".join(" -> ".join(c[-3:]) for c in cycle[:5])


def test_every_registered_model_has_its_parts():
    for kind, entry in registry.MODELS.items():
        assert callable(registry.package(kind).load), kind
        assert registry.config_class(kind).__module__.startswith(entry.package), kind
        assert (ROOT / "config" / entry.contract).is_file(), f"{kind}: no config/{entry.contract}"
        assert registry.resolve(entry.binding).name == kind
