"""Registers the Qwen3.5 architectures (dense and MoE). Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("qwen35", "leat_arch_qwen35.qwen35:Qwen35")
    register("qwen35moe", "leat_arch_qwen35.qwen35:Qwen35Moe")
