"""The house's rules, checked on the source: the library imports nothing above it and has no import
circle, the services stand on the library only, every algorithm has its room, no algorithm name is
switched on outside the registries, and the worker's algorithms use only their typed context."""

import ast
import os
import re

from mdgan.algorithms import ALGORITHMS, SERVED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = tuple(ALGORITHMS)


def _python_files(*tops: str) -> list[str]:
    found = []
    for top in tops:
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            if "/proto" in folder or "__pycache__" in folder:
                continue
            found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def _module(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[:-9] if rel.endswith(".__init__") else rel


def _imports(path: str) -> set[str]:
    """Every module a file imports (function-level too; TYPE_CHECKING blocks left out)."""
    tree = ast.parse(open(path).read(), path)
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    me = _module(path)
    package = me if path.endswith("__init__.py") else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_the_library_imports_nothing_above_it():
    forbidden = ("services", "mdgan_app", "grpc", "prometheus_client", "argparse")
    upward = [f"{_module(p)} -> {m}" for p in _python_files("mdgan") for m in _imports(p)
              if m.split(".")[0] in forbidden]
    assert upward == []


def test_the_services_import_no_application_module():
    upward = [f"{_module(p)} -> {m}" for p in _python_files("services") for m in _imports(p)
              if m.split(".")[0] == "mdgan_app"]
    assert upward == []


def test_the_library_has_no_import_circle():
    modules = {_module(p): p for p in _python_files("mdgan")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target and target not in (name, "mdgan"):
                targets.add(target)
        edges[name] = targets

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(edges[start])
        while todo:
            current = todo.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                todo += edges.get(current, ())
        return False

    circles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and reaches(b, a))
    assert circles == []


def test_every_algorithm_has_its_room_in_the_library_and_on_both_sides():
    from services.server.algorithms import ALGORITHMS as SERVER
    from services.worker.algorithms import ALGORITHMS as WORKER

    for name in NAMES:
        room = os.path.join(REPO, "mdgan", "algorithms", name)
        assert os.path.isdir(room) or os.path.isfile(room + ".py"), name
    assert tuple(SERVER) == tuple(WORKER) == SERVED  # the services run exactly what the registry serves
    for name in SERVED:
        for side in ("server", "worker"):
            room = os.path.join(REPO, "services", side, "algorithms", name)
            assert os.path.isdir(room) or os.path.isfile(room + ".py"), (side, name)


# An algorithm's name compared with something, or two or more names listed together: a switch.
_QUOTED = r"""["'](?:%s)["']""" % "|".join(NAMES)
SWITCH = re.compile(rf"(?:==|!=|\bnot in|\bin)\s*[(\[{{]?\s*{_QUOTED}|{_QUOTED}\s*(?:==|!=)|{_QUOTED}\s*,\s*{_QUOTED}")


def test_no_algorithm_name_is_switched_on_outside_the_registries():
    switches = []
    for path in _python_files("mdgan", "mdgan_app", "services"):
        for number, line in enumerate(open(path), 1):
            if SWITCH.search(line.split("#")[0]):
                switches.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert switches == []


def test_the_switch_pattern_finds_switches():
    """The test above can fail: each of these is a switch it must see."""
    for line in ('if args.algorithm == "pwgan":', 'elif algorithm in ("pwgan", "psgan"):',
                 'ALGORITHMS = ("mdgan", "flgan")', 'if "standalone" != name:'):
        assert SWITCH.search(line), line
    assert not SWITCH.search('name="pwgan", title="P-WGAN"')  # an algorithm naming itself is no switch


def test_the_peer_service_uses_only_its_typed_host():
    from services.worker.context import PeerHost
    from services.worker.node import WorkerNode

    declared = set(PeerHost.__annotations__) | {n for n in vars(PeerHost) if not n.startswith("_")}
    source = open(os.path.join("services", "worker", "peer.py")).read()
    used = set(re.findall(r"\bhost\.(\w+)", source))
    assert used and used <= declared, used - declared
    assert not re.search(r"\bnode\.", source)  # it holds no WorkerNode to reach into
    node = WorkerNode.__init__.__code__.co_names + tuple(vars(WorkerNode))
    assert [name for name in declared if name not in node and not hasattr(WorkerNode, name)] == []


def test_worker_algorithms_use_only_their_typed_context():
    from services.worker.context import WorkerContext
    from services.worker.node import WorkerNode

    declared = set(WorkerContext.__annotations__) | {n for n in vars(WorkerContext) if not n.startswith("_")}
    used = set()
    for path in _python_files(os.path.join("services", "worker", "algorithms")):
        used |= set(re.findall(r"\bnode\.(\w+)", open(path).read()))
    assert used <= declared, used - declared
    node = WorkerNode.__init__.__code__.co_names + tuple(vars(WorkerNode))
    missing = [name for name in declared if name not in node and not hasattr(WorkerNode, name)]
    assert missing == []
