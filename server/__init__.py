"""The coordinator: step loop, task planning, aggregation, noise, ledger-first release."""
