"""The house plan holds: no import circle between packages or modules, the dependency direction the README
states, bench/ built on testbed/ and never on tests/, and no function a reader cannot hold at once (radon
complexity D or worse). Read from the source with `ast` and radon, so a change that breaks the plan fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("hub", "node", "shared", "tui")
WORST_RANK = "C"  # radon: A-C reads at once; D (21+) and worse is split


def modules(tops: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module under these top-level packages."""
    found = {}
    for top in tops:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `path` imports, at the top or inside a function (a lazy import is still an edge)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n in known}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one vertex (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str, known: dict[str, Path]) -> str:
    return module if known[module].name == "__init__.py" else module.rpartition(".")[0]


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    known = modules((*PRODUCT, "testbed"))
    return known, {m: imports(p, known) - {m} for m, p in known.items()}


def test_no_circle_between_modules_or_between_packages(graph):
    known, edges = graph
    assert circles(edges) == []
    packages: dict[str, set[str]] = {}
    for module, targets in edges.items():
        source = package_of(module, known)
        packages.setdefault(source, set()).update(t for t in (package_of(t, known) for t in targets) if t != source)
    assert circles(packages) == []


def test_circles_are_found():
    """The checker itself: a circle of three, and a tree that has none."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("shared", ("hub", "node", "tui", "testbed")),
        ("node", ("hub", "testbed")),
        ("tui", ("hub", "node", "testbed")),
        ("hub", ("testbed",)),
        (
            "hub.method",
            (
                "hub.config",
                "hub.records",
                "hub.trust",
                "hub.distribution",
                "hub.control",
                "hub.training",
                "hub.service",
                "hub.cli",
            ),
        ),
        ("hub.training", ("hub.service", "hub.cli", "hub.distribution", "hub.control")),
        ("hub.service", ("hub.cli",)),
    ],
)
def test_dependencies_point_one_way(graph, importer, forbidden):
    """The README's direction: hub/, node/, tui/ build on shared/; node/ never imports hub/ (hub/ imports node/
    only to fork local nodes); the training side knows nothing of the node protocol or the hub's state."""
    _, edges = graph
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in edges.items()
        if m == importer or m.startswith(importer + ".")
        for t in targets
        if any(t == f or t.startswith(f + ".") for f in forbidden)
    )
    assert wrong == []


def test_only_the_commands_start_the_dashboard(graph):
    """The dashboard is a process of its own: the commands that open it import tui/, nothing else does."""
    _, edges = graph
    importers = {m for m, targets in edges.items() if not m.startswith("tui") and any(t.startswith("tui") for t in targets)}
    assert importers <= {"hub.cli.main", "node.cli"}, importers


def test_bench_builds_on_testbed_never_on_tests():
    scripts = sorted((ROOT / "bench").glob("*.py"))
    offenders = {}
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            bad = [n for n in names if n == "tests" or n.startswith("tests.")]
            if bad:
                offenders[path.name] = bad
    assert scripts and offenders == {}


def test_no_function_is_past_what_a_reader_holds():
    from radon.complexity import cc_rank, cc_visit

    too_complex = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            for block in cc_visit(path.read_text()):
                if cc_rank(block.complexity) > WORST_RANK:
                    too_complex.append(
                        f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname} "
                        f"{cc_rank(block.complexity)} ({block.complexity})"
                    )
    assert too_complex == []


def test_the_readmes_layout_is_the_tree():
    """README's Layout block names every top-level folder and hub/ room that exists, and nothing that does not."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Layout", 1)[1].split("```")[1]
    named = {line.split()[0].rstrip("/") for line in block.splitlines() if line.strip()}
    hub_rooms = {p.parent.name for p in (ROOT / "hub").glob("*/__init__.py")}
    top = {"hub", "node", "shared", "tui", "testbed", "tests", "bench", "docs"}
    assert named == top | hub_rooms | {"config.py"}
    assert all((ROOT / name).is_dir() for name in top)


# -- the hub's state: three owners, classes a reader holds, a composition root built in order ----------------------

MAX_PUBLIC_METHODS = 25
# Each owner's records (the dataclass in hub/records/) and the only modules that may assign to their fields.
OWNED_RECORDS = {
    ("hub/records/fleet.py", "NodeRecord"): {"hub/service/membership.py", "hub/records/fleet.py"},
    ("hub/records/leases.py", "LeaseRecord"): {"hub/service/leasing.py", "hub/records/leases.py"},
}
COMPOSITION_ROOT = "hub/cli/run.py"


def public_methods(tops: tuple[str, ...]) -> dict[str, int]:
    """Dotted class name -> the public methods (properties included) its own body defines."""
    counts = {}
    for module, path in modules(tops).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                counts[f"{module}.{node.name}"] = sum(
                    isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("_") for f in node.body
                )
    return counts


def test_no_class_in_hub_has_more_public_methods_than_a_reader_holds():
    counts = public_methods(("hub",))
    assert {name: n for name, n in counts.items() if n > MAX_PUBLIC_METHODS} == {}


def record_fields(path: str, name: str) -> set[str]:
    """The fields a dataclass declares."""
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise AssertionError(f"no class {name} in {path}")


def assigned_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of every assignment to an attribute of something other than `self`."""
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else ([node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        )
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.ctx, ast.Store)
                    and not (isinstance(part.value, ast.Name) and part.value.id == "self")
                ):
                    found.append((part.lineno, part.attr))
    return found


def owner_record_writes(root: Path) -> list[str]:
    """Assignments to an owner's record fields in a module outside that owner."""
    wrong = []
    for (path, name), owners in OWNED_RECORDS.items():
        fields = record_fields(path, name)
        for module in sorted((root / "hub").rglob("*.py")):
            where = str(module.relative_to(root))
            if where in owners:
                continue
            wrong += [
                f"{where}:{line} {name}.{attr}"
                for line, attr in assigned_attributes(ast.parse(module.read_text()))
                if attr in fields
            ]
    return wrong


def test_only_an_owner_writes_its_records():
    """The fleet's node records are Membership's to write, the lease records Leasing's: everyone else reports to
    them (the broadcaster's dial-backs, the intake's tallies) or reads."""
    assert owner_record_writes(ROOT) == []


def test_the_record_check_sees_a_write(tmp_path):
    """The checker itself: a module outside the owners that sets a node's state is caught."""
    for path in {p for p, _ in OWNED_RECORDS}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((ROOT / path).read_text())
    (tmp_path / "hub/service").mkdir(parents=True, exist_ok=True)
    (tmp_path / "hub/service/rogue.py").write_text(
        "def f(record, lease):\n    record.state = 'banned'\n    lease.closed, x = True, 1\n    self.state = 1\n"
    )
    assert owner_record_writes(tmp_path) == [
        "hub/service/rogue.py:2 NodeRecord.state",
        "hub/service/rogue.py:3 LeaseRecord.closed",
    ]


def lambdas_given_to_constructors(source: str) -> list[str]:
    """`Name(..., lambda ...)` calls: a lambda handed to a class being built (a stand-in for a later component)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if not name[:1].isupper():
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if any(isinstance(part, ast.Lambda) for part in ast.walk(arg)):
                found.append(f"{name} at line {node.lineno}")
    return found


def test_the_composition_root_builds_in_order():
    """hub/cli/run.py builds each component after those it needs: no lambda stands in for one not built yet."""
    assert lambdas_given_to_constructors((ROOT / COMPOSITION_ROOT).read_text()) == []
    assert lambdas_given_to_constructors("x = Thing(1, key=lambda: later.value)\ny = make(lambda: 1)\n") == ["Thing at line 1"]


def test_the_intakes_steps_are_numbered_alike_in_its_code_its_docstring_and_the_architecture():
    """A submission's path: the numbered steps of hub/service/intake.py's docstring, the step marks in its code (in
    order, each step once) and the numbered list in docs/ARCHITECTURE.md are the same steps."""
    import re

    source = (ROOT / "hub/service/intake.py").read_text()
    docstring = ast.get_docstring(ast.parse(source))
    described = [int(n) for n in re.findall(r"^ ?(\d+)\. ", docstring, re.MULTILINE)]
    marked: list[int] = []
    for first, last in re.findall(r"  # (\d+)(?:-(\d+))?$", source, re.MULTILINE):
        marked += range(int(first), int(last or first) + 1)
    architecture = (ROOT / "docs/ARCHITECTURE.md").read_text()
    intake = architecture[architecture.index("4. **The intake**") : architecture.index("5. **Learner step.**")]
    listed = [int(n) for n in re.findall(r"^    (\d+)\. \*", intake, re.MULTILINE)]
    assert described == marked == listed == list(range(1, 12))
