"""The forcer service: Token forcing of a system's outputs through the stock target.

Until its issue builds it, it starts, registers with NATS micro discovery, and does nothing else.
"""

from specpilot import service

NAME = "forcer"
DESCRIPTION = "Token forcing of a system's outputs through the stock target."


def main(argv: list[str] | None = None) -> None:
    service.main(NAME, DESCRIPTION, argv=argv)
