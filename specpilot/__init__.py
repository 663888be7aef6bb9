"""SpecPilot's shared core: event schema, subjects, bus, ledger, local NATS server, CLI."""

__version__ = "0.1.0"
