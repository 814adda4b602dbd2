"""Tools for developing modelfleet: private brokers for tests and benchmarks.

Nothing that serves imports them."""
