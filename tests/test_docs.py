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
