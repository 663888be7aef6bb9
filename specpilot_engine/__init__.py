"""The system under optimisation: a compact PyTorch speculative-decoding engine (the patchable runtime).

What runs inside a deployed system lives here and in `specpilot_kernels`, nothing else: the model,
decoding and verification, drafters, option dataclass, weights and the entry point
`specpilot_engine.api.build_engine` / `Engine.generate`. The harness that measures it (timing worker,
replay, request sets, deployments, profiler, forcing, drafter training) lives in `specpilot.harness` and
is never part of a patch. Nothing here imports `specpilot`'s harness, services or app (a test checks).
Importing this package imports nothing heavy.
"""
