"""`talaria`: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

import click

from talaria import __version__
from talaria.cli.config_cmd import config
from talaria.cli.drain_cmd import drain
from talaria.cli.profile_cmd import profile
from talaria.cli.replay_cmd import replay
from talaria.cli.sim_cmd import sim
from talaria.cli.trace_cmd import trace
from talaria.cli.tui_cmd import tui
from talaria.cli.up import up


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="talaria")
def cli() -> None:
    """Talaria serves several LLMs on one tensor-parallel group to tool-using agents.

    Start with `talaria up` (the embedded default config runs on a laptop CPU), then point any
    OpenAI client at http://127.0.0.1:8000/v1.
    """


cli.add_command(up)
cli.add_command(config)
cli.add_command(trace)
cli.add_command(profile)
cli.add_command(replay)
cli.add_command(sim)
cli.add_command(tui)
cli.add_command(drain)


if __name__ == "__main__":
    cli()
