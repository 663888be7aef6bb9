"""Fixtures of the backbone tests."""

import pytest

from tests.conftest import spawn_service, wait_for_services


@pytest.fixture
def memory(server):
    """A memory service on the test's server, stopped after the test."""
    proc = spawn_service(server, "memory")
    wait_for_services(server, {"memory"})
    yield proc
    proc.terminate()
    proc.wait(timeout=20)
