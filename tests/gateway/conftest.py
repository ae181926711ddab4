"""Async tests in this folder run on asyncio through anyio's pytest plugin (no pytest-asyncio)."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
