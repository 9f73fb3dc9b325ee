"""Registers the Qwen3.5 architecture. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("qwen35", "leat_arch_qwen35.qwen35:Qwen35")
