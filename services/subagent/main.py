"""The subagent service: Turns one direction into one patch behind an engine option.

Until its issue builds it, it starts, registers with NATS micro discovery, and does nothing else.
"""

from specpilot import service

NAME = "subagent"
DESCRIPTION = "Turns one direction into one patch behind an engine option."


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, argv=argv)
