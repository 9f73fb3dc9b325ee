"""Write docs/cli.md from the click CLI: `uv run python docs/gen_cli.py` (tests/test_docs.py fails when it is stale)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

HEADER = """# Command line reference

Generated from the `leat` command's own help by `docs/gen_cli.py`; do not edit by hand
(`uv run python docs/gen_cli.py` rewrites it, and `tests/test_docs.py` fails when it is stale).
"""


def _sections(command: click.Command, path: list[str], parent: click.Context | None) -> list[str]:
    settings = {"terminal_width": 100, "max_content_width": 100, **command.context_settings}
    ctx = click.Context(command, info_name=path[-1], parent=parent, **settings)
    out = [f"## `{' '.join(path)}`\n", "```text", command.get_help(ctx).rstrip(), "```\n"]
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(ctx)):
            out += _sections(command.get_command(ctx, name), [*path, name], ctx)
    return out


def cli_markdown() -> str:
    from leat.cli import cli

    return HEADER + "\n" + "\n".join(_sections(cli, ["leat"], None))


if __name__ == "__main__":
    target = Path(__file__).parent / "cli.md"
    target.write_text(cli_markdown())
    print(f"wrote {target}", file=sys.stderr)
