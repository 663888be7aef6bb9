"""SpecPilot's shared core, torch-free: event schema, subjects, bus, ledger, reads, local NATS server, policy,
the LLM tool loop, memory entries, forcing rules. Its subpackages are the layers above it: `harness` and
`app` here, and, from the repository's top-level folders, the runtime `engine` and `kernels` and the
`services` (`specpilot.layout` maps them); docs/DESIGN.md §1."""

from specpilot import layout as _layout

__version__ = "0.2.0"  # the one place the version is written (pyproject reads it)

_layout.install()
