"""Hookimpls only, and nothing heavy imported: what is registered is a lazy "module:Class" reference."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("example", "leat_example.architecture:Example")
