"""Every test here starts 2-4 training processes: slow, so the README's quick selection skips them (CI runs them).
The whole-CLI torchrun runs live in tests/cli, each marked slow where it is defined."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/distributed/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
