"""Everything under tests/integration starts real processes (peers, p2pd, a coordinator, a browser): marked as such,
so `pytest -m "not integration"` and `pytest tests/unit` are the fast tier."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.path):
            item.add_marker(pytest.mark.integration)
