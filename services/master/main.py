"""The master service: Plans directions from the cost model, integrates winners, starts the sealed final.

Until its issue builds it, it starts, registers with NATS micro discovery, and does nothing else.
"""

from specpilot import service

NAME = "master"
DESCRIPTION = "Plans directions from the cost model, integrates winners, starts the sealed final."


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, argv=argv)
