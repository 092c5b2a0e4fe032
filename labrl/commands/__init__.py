"""CLI command groups (see labrl.cli)."""
