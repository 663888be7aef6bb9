"""SpecPilot services; each talks to the others only over NATS."""
