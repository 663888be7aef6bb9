"""The controller service: Isolated: checks, applies, tests and times patches; the only service that promotes.

Until its issue builds it, it starts, registers with NATS micro discovery, and does nothing else.
"""

from specpilot import service

NAME = "controller"
DESCRIPTION = "Isolated: checks, applies, tests and times patches; the only service that promotes."


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, argv=argv)
