"""`kvmem` commands of this area (see COMMANDS)."""

import click

COMMANDS: list[click.Command] = []
