"""Registers the GLM-4.5 MoE architecture. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("glm4moe", "leat_arch_glm4moe.glm4moe:Glm4Moe")
