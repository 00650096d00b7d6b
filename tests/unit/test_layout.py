"""Dependencies point one way: the package rules of docs/ARCHITECTURE.md, walked with ast.

Each package may import itself and the packages listed for it, nothing else of ours;
Ray Serve is imported only in ``services.serving``, FastAPI and Starlette only in
``api``. A violation names the file, the line and the arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("api", "services", "target_actor", "drafter_actor")

# package -> the packages of ours it may import (besides itself); most specific first
ALLOWED: dict[str, tuple[str, ...]] = {
    "target_actor": (),
    "drafter_actor": ("target_actor",),
    "services.engine": ("drafter_actor", "target_actor"),
    "api": ("services.engine",),
    "services.data": ("services.engine", "drafter_actor", "target_actor"),
    # the replica places target ranks and the drafter as actors in its placement group
    "services.serving": ("api", "services.engine", "drafter_actor", "target_actor"),
    "services.bench": (
        "services.serving",
        "services.data",
        "services.engine",
        "drafter_actor",
        "target_actor",
    ),
    "services.cli": (
        "services.serving",
        "services.bench",
        "services.data",
        "services.engine",
        "drafter_actor",
        "target_actor",
    ),
    "services": (),  # services/__init__.py
}
ONLY_IN = {  # third-party package -> the one package of ours that may import it
    "ray.serve": ("services.serving",),
    "fastapi": ("api",),
    "starlette": ("api",),
}


def package_of(module: str) -> str:
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len)


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    out = []
    is_pkg = path.name == "__init__.py"
    parts = module.split(".")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts if is_pkg else parts[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name in OURS:  # `from services import cli`: the names are the modules
                out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, name))
    return out


def violations(path: Path, module: str) -> list[str]:
    own = package_of(module)
    bad = []
    for line, name in imports(path, module):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
        if name.split(".")[0] in OURS:
            target = (
                package_of(name)
                if any(name == p or name.startswith(p + ".") for p in ALLOWED)
                else name
            )
            if target != own and target not in ALLOWED[own] and name not in ALLOWED[own]:
                if not (own == "services" and target.startswith("services.")):
                    bad.append(f"{where}: {own} -> {target} ({name})")
        for lib, homes in ONLY_IN.items():
            if (name == lib or name.startswith(lib + ".")) and own not in homes:
                bad.append(f"{where}: {own} imports {lib} (only {', '.join(homes)} may)")
    return bad


def our_files():
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield path, ".".join(parts)


def test_imports_follow_the_package_rules():
    bad = [v for path, module in our_files() for v in violations(path, module)]
    assert not bad, "imports against the package rules:\n" + "\n".join(bad)


def test_a_planted_upward_import_is_caught(tmp_path):
    planted = tmp_path / "rejection.py"
    planted.write_text("import torch\nfrom drafter_actor.messages import Proposal\n")
    assert violations(planted, "target_actor.rejection") == [
        f"{planted}:2: target_actor -> drafter_actor (drafter_actor.messages)"
    ]
    api_file = tmp_path / "errors.py"
    api_file.write_text("from ray.serve.exceptions import BackPressureError\n")
    (found,) = violations(api_file, "api.errors")
    assert "api imports ray.serve" in found
    relative = tmp_path / "scheduler.py"
    relative.write_text("from ..serving.app import build_app\n")
    (found,) = violations(relative, "services.engine.scheduler")
    assert "services.engine -> services.serving" in found


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(
        getattr(protocol, "__annotations__", {})
    )


def test_every_handle_implements_its_protocol():
    """In-process, Ray and fault-tolerant handles: the same calls (methods and fields)."""
    import inspect

    from drafter_actor.handle import DrafterHandle
    from drafter_actor.worker import LocalDrafter, RayDrafter
    from services.engine.resilient_drafter import ResilientDrafter
    from target_actor.handle import TargetHandle
    from target_actor.worker import LocalTarget, TargetGroup

    for protocol, classes in [
        (TargetHandle, (LocalTarget, TargetGroup)),
        (DrafterHandle, (LocalDrafter, RayDrafter, ResilientDrafter)),
    ]:
        for cls in classes:
            init = inspect.getsource(cls.__init__)
            missing = [
                n
                for n in sorted(members(protocol))
                if not hasattr(cls, n) and f"self.{n}" not in init and f"self.{n}," not in init
            ]
            assert not missing, f"{cls.__name__} lacks {missing} of {protocol.__name__}"
