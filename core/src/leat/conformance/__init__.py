"""leat's conformance kit: base test classes a backend or architecture author subclasses, as pandas' extension tests.

Load it in your plugin's tests (``conftest.py``)::

    pytest_plugins = ["leat.conformance"]

then subclass and provide the fixture::

    from leat.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture(params=["f32"])
        def backend(self, request):
            return MyBackend(request.param)

Every test of the base class then runs against your plugin: the same op, quantization and model-agreement checks
leat's own plugins pass. See :class:`BackendConformance` and :class:`ArchitectureConformance`.
"""

from leat.conformance.architecture import ArchitectureConformance
from leat.conformance.backend import BackendConformance

__all__ = ["ArchitectureConformance", "BackendConformance"]


def pytest_report_header(config) -> str:
    from leat import __version__

    return f"leat conformance kit (leat {__version__})"
