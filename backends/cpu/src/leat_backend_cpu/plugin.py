"""Registers the numpy CPU backend. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_backends(register):
    register("cpu", "leat_backend_cpu.backend:CPUBackend", priority=0)
