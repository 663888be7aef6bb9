"""The system under optimisation: a compact PyTorch speculative-decoding engine.

Entry points (see engine/README.md): `engine.api.load_engine` / `Engine.generate` for harnesses,
``python -m engine.worker`` for timed runs, `engine.options` for the option dataclass and its flags,
`engine.deployment.load_deployment`, `engine.requests.load_requests`, `engine.cli.add_commands`.
Importing this package imports nothing heavy.
"""
