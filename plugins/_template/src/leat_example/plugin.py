"""Hookimpls only, and nothing heavy imported: what is registered is a lazy "module:Class" reference."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("example", "leat_example.architecture:Example")


@hookimpl
def register_samplers(register):
    register("top_a", "leat_example.extensions:TopA")


@hookimpl
def register_chat_formats(register):
    register("example", "leat_example.extensions:ExampleCalls")


@hookimpl
def register_commands(register):
    register("example-tiny", "leat_example.extensions:tiny_command")
