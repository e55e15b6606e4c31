"""The native lane: the per-job path in compiled code (docs/design.md, "The native lane")."""
