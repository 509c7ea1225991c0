"""Execution-state capsules: snapshot / restore / fork of a runtime's persistent buffers."""
from flashrt_core.capsule.cli import add_subparsers, capsule_inspect
from flashrt_core.capsule.diskfmt import Check, inspect
from flashrt_core.capsule.fingerprint import Fingerprint, fingerprint
from flashrt_core.capsule.store import TIERS, CapsuleStore

__all__ = ["CapsuleStore", "Fingerprint", "fingerprint", "inspect", "Check", "capsule_inspect",
           "add_subparsers", "TIERS"]
