"""fxpipe model zoo."""
