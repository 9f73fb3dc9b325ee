"""Registers the deepseek2 architecture. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("deepseek2", "leat_arch_deepseek2.deepseek2:DeepSeek2")
