"""Parallelism: degrees and mesh, TP, CP, PP, activation checkpointing, compile, FSDP, dry-run planning."""
