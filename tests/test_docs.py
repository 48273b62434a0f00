"""The README and the docs site are tested by running them, not by pinning their wording.

Every ``bash`` and ``python`` block of README.md and docs/ carries a marker on the line before
its fence (an HTML comment: neither GitHub nor the site shows it):

* ``<!-- docs-test: run -->``: the block runs (bash with ``-e -o pipefail``; python as a
  script) and must exit 0. The blocks of a page run in order, in the page's own copy of the
  work folder, so a block may use what an earlier block of its page wrote.
* ``<!-- docs-test: skip REASON -->``: it does not run (it needs a cluster, a GPU, an object
  store, the network, or your own model); the reason shows in pytest's skip summary.
* ``<!-- docs-test: file PATH -->`` (any language): the block is written to PATH in the
  page's work folder, e.g. a recipe that a later block builds.

The work folder is offline and made once per session, as a clone's root is after the
README's first command: ``recipes/`` (a copy of the bundled recipes, with the quickstart's
documents, tokenizer and conversations under ``recipes/quickstart/``) and ``quickstart-cache/``
(built from ``recipes/quickstart.toml``). Nothing else: an example names files the repository
has.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardcache.cli import main

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
RUNNABLE = ("bash", "python")
MARKER = re.compile(r"<!--\s*docs-test:\s*(run|skip|file)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```\s*$",
                   re.S | re.M)  # fmt: skip


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int
    lang: str
    body: str
    action: str | None  # run | skip | file, or None when unmarked
    argument: str  # the skip reason or the file path

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the marker on the line before it."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        indent = len(match["indent"])
        body = "\n".join(line[indent:] for line in match["body"].splitlines()) + "\n"
        blocks.append(Block(
            page=str(path.relative_to(REPO)), line=text.count("\n", 0, match.start()) + 1,
            lang=match["lang"], body=body, action=marker[1] if marker else None,
            argument=marker[2] if marker else "",
        ))  # fmt: skip
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
TO_RUN = [b for b in BLOCKS if b.lang in RUNNABLE or b.action == "file"]


# ------------------------------------------------------------------- running the blocks


@pytest.fixture(scope="session")
def docs_home(tmp_path_factory) -> Path:
    """The work folder every page starts from, with the quickstart cache built once."""
    home = tmp_path_factory.mktemp("docs-home")
    shutil.copytree(REPO / "recipes", home / "recipes",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "shardcache", "build", "recipes/quickstart.toml", "-q"],
        cwd=home, env=_env(tmp_path_factory.getbasetemp()), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return home


def _env(base: Path) -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)  # `shardcache`, `python` of this environment
    return {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "SHARDCACHE_CACHE_DIR": str(base / "shardcache-home"),
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="session")
def page_folders() -> dict[str, Path]:
    """Each page's work folder (a copy of the docs home), made by its first block."""
    return {}


@pytest.mark.parametrize("block", TO_RUN, ids=[b.id for b in TO_RUN])
def test_docs_block_runs(block: Block, docs_home, page_folders, tmp_path_factory):
    if block.action == "skip":
        pytest.skip(f"{block.id}: {block.argument}")
    assert block.action in ("run", "file"), f"{block.id}: unmarked (see tests/test_docs.py)"
    folder = page_folders.get(block.page)
    if folder is None:
        folder = tmp_path_factory.mktemp("page") / "work"
        shutil.copytree(docs_home, folder, symlinks=True)
        page_folders[block.page] = folder
    if block.action == "file":
        path = folder / block.argument
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.body, encoding="utf-8")
        return
    script = folder / f"_block_{block.line}.{'sh' if block.lang == 'bash' else 'py'}"
    script.write_text(block.body, encoding="utf-8")
    command = (["bash", "-e", "-o", "pipefail", script.name] if block.lang == "bash"
               else [sys.executable, script.name])  # fmt: skip
    out = subprocess.run(command, cwd=folder, env=_env(tmp_path_factory.getbasetemp()),
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, (
        f"{block.id} exited {out.returncode}\n{block.body}\n"
        f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
    )


def test_every_shell_and_python_block_is_marked():
    unmarked = [b.id for b in BLOCKS if b.lang in RUNNABLE and b.action is None]
    assert not unmarked, f"blocks without a <!-- docs-test: ... --> marker: {unmarked}"
    reasonless = [b.id for b in BLOCKS if b.action == "skip" and not b.argument]
    assert not reasonless, f"skipped blocks without a reason: {reasonless}"
    assert sum(b.action == "run" for b in BLOCKS) >= 20


# ----------------------------------------------------- what running cannot check by itself


def _command_lines(blocks: list[Block]) -> list[str]:
    """The command lines of bash blocks (continuations joined, comments off)."""
    lines = []
    for block in blocks:
        for line in block.body.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s+)#.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines


def test_every_shardcache_command_in_the_docs_parses():
    """Skipped blocks (clusters, object stores) are not run: their options still parse."""
    bash = [b for b in BLOCKS if b.lang == "bash"]
    commands = []
    for line in _command_lines(bash):
        for part in re.split(r"&&|;|\||>", line):
            words = shlex.split(part)
            if "shardcache" in words and "$(" not in part:
                commands.append(words[words.index("shardcache") + 1 :])
    assert len(commands) >= 15
    for args in commands:
        if not args or args[0].startswith(("-", "<")) or "--help" in args:
            continue
        assert args[0] in main.commands, f"the docs run an unknown command: shardcache {args}"
        main.commands[args[0]].make_context(args[0], list(args[1:]))  # raises on a bad option


def test_every_repository_path_and_link_exists():
    checked = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        written = set(re.findall(r">\s*([\w./-]+)", text))  # files the page's blocks write
        named = re.findall(
            r"\b((?:recipes|benchmarks|tests|shardcache)/[\w./-]+\.(?:toml|py))", text
        )
        for path in set(named) - written:
            assert (REPO / path).exists(), f"{page.name} names a missing file {path}"
        for link in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", text):
            assert (page.parent / link).exists(), f"{page.name} links to a missing {link}"
            checked += 1
        assert "pip index versions" not in text  # cannot work before a release
    assert checked >= 20, f"only {checked} links found: is the link pattern still right?"


#: The widest code line a page shows without clipping it (the site's code blocks, GitHub's).
CODE_WIDTH = 88


def test_code_lines_fit_the_page():
    """Commands, programs and recipes are wrapped; a program's printed output may be wider."""
    wide = [
        f"{b.id}: {len(line)} chars: {line[:60]}..."
        for b in BLOCKS
        if b.lang in (*RUNNABLE, "toml")
        for line in b.body.splitlines()
        if len(line) > CODE_WIDTH
    ]
    assert not wide, "code lines wider than the page:\n" + "\n".join(wide)


def test_every_guide_is_reachable_from_the_home_page():
    home = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((guide/[\w-]+\.md)(?:#[^)]*)?\)", home))
    guides = {f"guide/{p.name}" for p in (REPO / "docs" / "guide").glob("*.md")}
    assert guides <= linked, f"docs/index.md does not link {sorted(guides - linked)}"


def test_ddp_resume_line_uses_the_options_the_state_was_saved_with():
    lines = [shlex.split(x) for x in _command_lines(BLOCKS) if "train_ddp.py" in x]
    options = ("--mode", "--seq-len", "--packing", "--max-tokens", "--seed")

    def plan(words):
        return {w: words[i + 1] for i, w in enumerate(words) if w in options}

    [saved] = [w for w in lines if "--save-state" in w]
    [resumed] = [w for w in lines if "--resume" in w]
    assert plan(resumed) == plan(saved)


def test_every_public_name_has_a_reference_entry():
    import shardcache

    reference = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    entries = re.findall(r"^::: shardcache\.(\w+)\s*$", reference, flags=re.M)
    assert sorted(entries) == sorted(set(entries)), "a name has two reference entries"
    assert set(entries) == set(shardcache.__all__), (
        f"missing: {sorted(set(shardcache.__all__) - set(entries))}, "
        f"stale: {sorted(set(entries) - set(shardcache.__all__))}"
    )


def test_every_command_has_help_and_a_docs_entry():
    commands = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, command in main.commands.items():
        assert (command.help or "").strip(), f"shardcache {name} has no help text"
        assert f"`shardcache {name}`" in commands, f"docs/cli.md lacks shardcache {name}"


def test_the_bad_records_section_lists_every_reason_and_flag():
    from shardcache.builder.chat import CHAT_BAD_REASONS
    from shardcache.builder.sources import BAD_REASONS

    page = (REPO / "docs" / "guide" / "building.md").read_text(encoding="utf-8")
    section = page.split("## Bad records", 1)[1].split("\n## ", 1)[0]
    for reason in (*BAD_REASONS, *CHAT_BAD_REASONS):
        assert f"`{reason}`" in section, f"the bad-records section lacks {reason}"
    for flag in ("--on-error", "--max-bad-fraction"):
        assert flag in section


def test_every_error_class_has_a_troubleshooting_entry():
    import inspect

    from shardcache import errors

    page = (REPO / "docs" / "guide" / "troubleshooting.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^#+ .*?`(\w+)`", page, flags=re.M))
    tree = {n for n, v in vars(errors).items()
            if inspect.isclass(v) and issubclass(v, errors.ShardcacheError)}  # fmt: skip
    assert tree <= headings, f"no troubleshooting entry for {sorted(tree - headings)}"


def test_ci_runs_the_readme_setup_commands_verbatim():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)
    assert len(commands) == 2, "the README starts with exactly two set-up commands"
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    for command in commands:
        assert command.strip() in ci


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's "The modules" lists each module by its path under its layer.

    A layer's section opens with a line starting `` `layer/` ``; a module in a subfolder of the
    layer is written with that folder (`` `plan/streams.py` ``); packages' ``__init__.py`` are
    not listed, except the package's own.
    """
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    found = re.search(r"^## The modules\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S)
    assert found, "docs/architecture.md has no '## The modules' section"
    sections = re.split(r"^`(\w+)/`", found.group(1), flags=re.M)
    module = r"`((?:\w+/)*\w+\.py)`"
    listed = {"": set(re.findall(module, sections[0]))}
    for layer, text in zip(sections[1::2], sections[2::2]):
        listed[layer] = set(re.findall(module, text))
    package = REPO / "shardcache"
    layers = {p.parent.name for p in package.glob("*/__init__.py")}
    assert set(listed) - {""} == layers, f"layer sections {sorted(listed)}, layers {sorted(layers)}"
    for layer, names in listed.items():
        if layer:
            files = {p.relative_to(package / layer) for p in (package / layer).rglob("*.py")}
            modules = {p.as_posix() for p in files if p.name != "__init__.py"}
        else:
            modules = {p.name for p in package.glob("*.py")}
        assert names == modules, (
            f"docs/architecture.md, {layer or 'shardcache'}/: "
            f"missing {sorted(modules - names)}, stale {sorted(names - modules)}"
        )
