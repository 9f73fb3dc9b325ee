"""leat's conformance kit: base test classes a backend or architecture author subclasses, as pandas' extension tests.

Put ``leat[conformance]`` in your plugin's test dependencies (it brings pytest and what the kit checks against: the
CPU backend's float64 oracle and the tiny llama files); the kit's pytest plugin loads itself (``pytest11``). Then
subclass and provide the fixture::

    from leat.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture(params=["f32"])
        def backend(self, request):
            return MyBackend(request.param)

Every test of the base class then runs against your plugin: the same op, quantization and model-agreement checks
leat's own plugins pass; ``capabilities`` says which optional checks apply to yours. When something the kit needs
is missing, its checks fail with a message saying what to install: they never skip. See :class:`BackendConformance`
and :class:`ArchitectureConformance`.
"""

from leat.conformance.architecture import ArchitectureConformance
from leat.conformance.backend import BackendConformance

__all__ = ["ArchitectureConformance", "BackendConformance"]
