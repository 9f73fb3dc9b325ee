"""Registers ``leat serve`` and ``leat receipts``. Imports nothing heavy (no Litestar, uvicorn or cryptography)."""

from leat import hookimpl


@hookimpl
def register_commands(register):
    register("serve", "leat_server.cli:serve")
    register("receipts", "leat_server.cli:receipts")
