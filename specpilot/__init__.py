"""SpecPilot's shared core, torch-free: event schema, subjects, bus, ledger, reads, local NATS server, policy,
the LLM tool loop, memory entries, forcing rules. Its subpackages are the layers above it (`harness`,
`services`, `app`); docs/DESIGN.md §1."""

__version__ = "0.2.0"  # the one place the version is written (pyproject reads it)
