"""Docstrings state contracts: every public callable says what it takes, returns and raises.

Walks ``shardcache/`` with ``ast`` (nothing is imported) and checks Google-style sections:

- a public function or method (name without a leading ``_``, in a public class for a method)
  has a docstring that begins with a summary; one that takes parameters (besides
  ``self``/``cls``) has ``Args:`` naming each of them (``*args``/``**kwargs`` by their names);
- ``Returns:`` when it returns a value (a return annotation other than ``None``/``NoReturn``),
  ``Yields:`` instead when it is a generator;
- ``Raises:`` naming every shardcache error (a subclass of ``ShardcacheError``) that its own
  body raises by name (``raise ConfigError(...)``); errors raised by callees are not required;
- a public class has a docstring; its constructor's parameters (an explicit ``__init__``, or a
  dataclass's fields) are named under ``Args:`` or ``Attributes:`` of the class docstring (or
  of ``__init__``'s), and errors raised by name in ``__init__``/``__post_init__`` under its
  ``Raises:``.

Exempt, each for a stated reason:

- dunder methods other than the constructor: their contract is the protocol's;
- ``@property``/``@cached_property`` (and setters): read as attributes, their docstring says
  what the value is;
- ``@overload`` stubs: the implementation carries the docstring;
- an override of a method defined by a shardcache base class (``Progress.advance`` in a
  subclass), or an implementation of a shardcache ``Protocol`` that the class's docstring
  names (``:class:`DeviceBackend```): the base's docstring is the contract, and it is checked;
- click command callbacks (``@<group>.command``/``@click.command``/``@click.group``): their
  ``--help`` is the documentation, and tests/test_cli.py checks every command has one;
- names in ``shardcache/__init__.py``: it only re-exports.
"""

from __future__ import annotations

import ast
import os
import re

import shardcache

PACKAGE = os.path.dirname(os.path.abspath(shardcache.__file__))
ROOT = os.path.dirname(PACKAGE)

PROPERTY_DECORATORS = {"property", "cached_property", "setter", "getter", "deleter"}
CLICK_DECORATORS = {"command", "group"}
SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Returns|Yields|Raises):\s*$")


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, ROOT).replace(os.sep, "/")] = path
    return dict(sorted(found.items()))


MODULES = _modules()


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


TREES = {rel: _parse(path) for rel, path in MODULES.items()}


def _name(node: ast.expr) -> str:
    """The last component of a name or attribute (``click.command`` -> ``command``)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a module or class body, looking into if/try/with blocks."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            out += _top_level(inner)
    return out


def _classes() -> dict[str, ast.ClassDef]:
    out = {}
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


CLASSES = _classes()


def _error_names() -> set[str]:
    errors = {"ShardcacheError"}
    grew = True
    while grew:
        grew = False
        for name, node in CLASSES.items():
            if name not in errors and any(_name(b) in errors for b in node.bases):
                errors.add(name)
                grew = True
    return errors


ERRORS = _error_names()


def _sections(doc: str) -> dict[str, set[str]]:
    """Section name -> the entry names under it (``Args:`` -> {"path", "*args"})."""
    out: dict[str, set[str]] = {}
    lines = doc.expandtabs().splitlines()
    i = 0
    while i < len(lines):
        match = SECTION.match(lines[i])
        if not match:
            i += 1
            continue
        kind = "Args" if match.group(2) == "Arguments" else match.group(2)
        indent, entries, entry_indent = len(match.group(1)), out.setdefault(kind, set()), None
        i += 1
        while i < len(lines):
            line = lines[i]
            if line.strip():
                here = len(line) - len(line.lstrip())
                if here <= indent:
                    break
                if entry_indent is None:
                    entry_indent = here
                if here == entry_indent:
                    entry = re.match(r"\s*(\**[\w.]+)\s*(\([^)]*\))?\s*:", line)
                    if entry:
                        entries.add(entry.group(1).lstrip("*"))
                        entries.add(entry.group(1).split(".")[-1])
            i += 1
    return out


def _own_nodes(func: ast.AST):
    """The nodes of a function's body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _raised(func: ast.AST) -> set[str]:
    out = set()
    for node in _own_nodes(func):
        if isinstance(node, ast.Raise) and node.exc is not None:
            name = _name(node.exc)
            if name in ERRORS:
                out.add(name)
    return out


def _params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = func.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return [n for n in names if n not in ("self", "cls")]


def _returns_value(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    if func.returns is not None:
        text = ast.unparse(func.returns).strip("'\"")
        return text not in ("None", "NoReturn", "typing.NoReturn", "Never")
    return any(
        isinstance(n, ast.Return) and n.value is not None and ast.unparse(n.value) != "None"
        for n in _own_nodes(func)
    )


def _is_generator(func: ast.AST) -> bool:
    return any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_nodes(func))


def _bases(cls: ast.ClassDef) -> list[str]:
    """Its base classes, and the shardcache Protocols its docstring names."""
    named = re.findall(r":class:`~?([\w.]+)`", ast.get_docstring(cls) or "")
    protocols = [
        n.split(".")[-1]
        for n in named
        if n.split(".")[-1] in CLASSES
        and any(_name(b) == "Protocol" for b in CLASSES[n.split(".")[-1]].bases)
    ]
    return [_name(b) for b in cls.bases] + protocols


def _defined_by_base(cls: ast.ClassDef, method: str, seen: set[str] | None = None) -> bool:
    seen = set() if seen is None else seen
    for name in _bases(cls):
        node = CLASSES.get(name)
        if node is None or name in seen:
            continue
        seen.add(name)
        if any(
            isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == method
            for m in node.body
        ):
            return True
        if _defined_by_base(node, method, seen):
            return True
    return False


def _missing(doc: str | None, params: list[str], returns: bool, yields: bool, raises: set[str],
             arg_sections: tuple[str, ...] = ("Args",)) -> list[str]:  # fmt: skip
    if doc is None:
        return ["docstring"]
    if SECTION.match(doc.splitlines()[0] if doc else ""):
        return ["a summary line before the sections"]
    sections = _sections(doc)
    named = set().union(*(sections.get(s, set()) for s in arg_sections))
    out = []
    absent = [p for p in params if p not in named]
    if absent:
        out.append(f"{'/'.join(arg_sections)} ({', '.join(absent)})")
    if yields and "Yields" not in sections:
        out.append("Yields")
    elif returns and not yields and "Returns" not in sections:
        out.append("Returns")
    unnamed = sorted(raises - sections.get("Raises", set()))
    if unnamed:
        out.append(f"Raises ({', '.join(unnamed)})")
    return out


def _check_function(func: ast.FunctionDef | ast.AsyncFunctionDef, where: str) -> list[str]:
    decorators = {_name(d) for d in func.decorator_list}
    if decorators & (PROPERTY_DECORATORS | {"overload"} | CLICK_DECORATORS):
        return []
    gaps = _missing(ast.get_docstring(func), _params(func), _returns_value(func),
                    _is_generator(func), _raised(func))  # fmt: skip
    return [f"{where}:{func.lineno} {func.name}: {', '.join(gaps)}"] if gaps else []


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any(_name(d) == "dataclass" for d in cls.decorator_list)


def _dataclass_fields(cls: ast.ClassDef) -> list[str]:
    out = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if "ClassVar" in annotation or node.target.id.startswith("_"):
                continue
            value = node.value
            if (isinstance(value, ast.Call) and _name(value.func) == "field"
                    and any(k.arg == "init" and ast.unparse(k.value) == "False"
                            for k in value.keywords)):  # fmt: skip
                continue
            out.append(node.target.id)
    return out


def _check_class(cls: ast.ClassDef, where: str) -> list[str]:
    methods = {
        m.name: m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    init, post_init = methods.get("__init__"), methods.get("__post_init__")
    docs = [ast.get_docstring(cls), ast.get_docstring(init) if init else None]
    doc = "\n\n".join(d for d in docs if d) or None
    params = _params(init) if init else _dataclass_fields(cls) if _is_dataclass(cls) else []
    raises = set().union(*(_raised(m) for m in (init, post_init) if m is not None))
    problems = []
    gaps = _missing(doc, params, False, False, raises, ("Args", "Attributes"))
    if gaps:
        problems.append(f"{where}:{cls.lineno} {cls.name}: {', '.join(gaps)}")
    for name, method in methods.items():
        if name.startswith("_") or _defined_by_base(cls, name):
            continue
        problems += _check_function(method, f"{where}:{cls.name}")
    return problems


def _problems(rel: str) -> list[str]:
    if rel == "shardcache/__init__.py":
        return []
    problems = []
    for node in _top_level(TREES[rel].body):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_"):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problems += _check_function(node, rel)
        elif isinstance(node, ast.ClassDef):
            problems += _check_class(node, rel)
    return problems


def test_public_docstrings_state_contracts() -> None:
    problems = [p for rel in MODULES for p in _problems(rel)]
    assert not problems, (
        f"{len(problems)} public functions/classes miss docstring sections (Google style):\n"
        + "\n".join(problems)
    )


def test_the_checker_reads_google_sections() -> None:
    doc = """Do a thing.

    Args:
        path: where.
        count (int): how many,
            over two lines: not an entry.
        **options: the rest.

    Returns:
        The thing.

    Raises:
        ConfigError: when.
    """
    sections = _sections(doc)
    assert sections["Args"] >= {"path", "count", "options"}
    assert "over" not in sections["Args"]
    assert sections["Raises"] == {"ConfigError"}
    assert "Returns" in sections
