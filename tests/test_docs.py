"""The README documents every command, and CI runs the README's own set-up commands."""

from __future__ import annotations

import os
import re

from shardcache.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
        return f.read()


def test_every_command_is_in_the_readme():
    readme = _read("README.md")
    for name in main.commands:
        assert f"`shardcache {name}`" in readme, f"README lacks a row for shardcache {name}"


def test_ci_runs_the_readme_setup_commands_verbatim():
    readme = _read("README.md")
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)
    assert len(commands) == 2, "the README starts with exactly two set-up commands"
    ci = _read(".ci", "run")
    for command in commands:
        assert command.strip() in ci


def test_every_public_name_has_a_readme_section():
    import shardcache

    readme = _read("README.md")
    api = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    headings = set(re.findall(r"^#### `([^`]+)`$", api, flags=re.M))
    rows = set(re.findall(r"^\| `([A-Za-z]+)` \|", api, flags=re.M))  # the errors table
    missing = sorted(set(shardcache.__all__) - headings - rows)
    assert not missing, f"README '## Python API' lacks a section for {missing}"


def test_pack_attention_and_batch_size_rules_are_up_front():
    readme = _read("README.md")
    batches = readme.split("### Batches: pad or pack\n\n", 1)[1]
    assert batches.startswith("> **Two rules, or training is silently wrong:**")
    box = batches.split("\n\n`ShardDataset`", 1)[0]
    assert "**Pack mode needs `attention=`**" in box
    assert "**`DataLoader(ds, batch_size=None)`**" in box


# issue 13 item 18: every command in the README runs as written from a fresh clone


def _code_lines(readme: str) -> list[str]:
    """The command lines of the README's bash blocks (continuations joined, comments off)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines


def _shardcache_commands(readme: str) -> list[list[str]]:
    import shlex

    commands = []
    for line in _code_lines(readme):
        for part in re.split(r"&&|;", line):
            words = shlex.split(part.replace("'", '"')) if "'" in part else shlex.split(part)
            if "shardcache" in words:
                commands.append(words[words.index("shardcache") + 1 :])
    return commands


def test_every_shardcache_command_in_the_readme_parses():
    commands = _shardcache_commands(_read("README.md"))
    assert len(commands) >= 15
    for args in commands:
        if not args or args[0].startswith("<"):
            continue
        name = args[0]
        assert name in main.commands, f"README runs an unknown command: shardcache {args}"
        command = main.commands[name]
        command.make_context(name, list(args[1:]))  # raises on an unknown option or value


def test_every_repository_path_in_the_readme_exists():
    readme = _read("README.md")
    for path in set(re.findall(r"\b((?:recipes|benchmarks|tests)/[\w./-]+\.(?:toml|py))", readme)):
        assert os.path.exists(os.path.join(REPO, path)), f"README names a missing file {path}"
    assert "pip index versions" not in readme  # cannot work before a release


def test_ddp_resume_line_uses_the_options_the_state_was_saved_with():
    import shlex

    lines = [shlex.split(x) for x in _code_lines(_read("README.md")) if "train_ddp.py" in x]
    options = ("--mode", "--seq-len", "--packing", "--max-tokens", "--seed")

    def plan(words):
        return {w: words[i + 1] for i, w in enumerate(words) if w in options}

    [saved] = [w for w in lines if "--save-state" in w]
    [resumed] = [w for w in lines if "--resume" in w]
    assert plan(resumed) == plan(saved)


def test_version_flag_and_completion_are_documented_and_work():
    from click.testing import CliRunner

    readme = _read("README.md")
    assert "shardcache -V" in readme and "_SHARDCACHE_COMPLETE=bash_source" in readme
    result = CliRunner().invoke(main, ["-V"])
    assert result.exit_code == 0 and "shardcache" in result.output


def test_the_bad_records_section_lists_every_reason_and_flag():
    from shardcache.builder.chat import CHAT_BAD_REASONS
    from shardcache.builder.sources import BAD_REASONS

    readme = _read("README.md")
    section = readme.split("**Bad records.**", 1)[1].split("\n**", 1)[0]
    for reason in (*BAD_REASONS, *CHAT_BAD_REASONS):
        assert f"`{reason}`" in section, f"README's bad-records section lacks {reason}"
    for flag in ("--on-error", "--max-bad-fraction"):
        assert flag in section
