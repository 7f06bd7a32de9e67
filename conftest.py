"""Suite-wide: each test's pytest timeout grows with AMPWATCH_TEST_SLOWDOWN, as every wait's deadline does
(ampwatch_support.patience)."""

from ampwatch_support.patience import _scaled_timeouts


def pytest_collection_modifyitems(config, items):
    _scaled_timeouts(items, config.getoption("timeout", None))
