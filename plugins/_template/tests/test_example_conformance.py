"""The example architecture through leat's conformance kit: the checks every architecture plugin passes."""

import pytest
from leat.conformance import ArchitectureConformance

pytest.importorskip("leat_example", reason="the template is tested once installed (tests/test_template_plugin.py)")


class TestExampleConformance(ArchitectureConformance):
    @pytest.fixture
    def architecture(self):
        from leat_example.architecture import Example

        return Example
