"""Validating the plan simulator against the runtime on plans a 2-core box cannot compute."""
