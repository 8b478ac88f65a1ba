"""Banks of speculative-decoding rounds in the public specdec-calibration layout (see schema)."""

from calib.bank.io import Bank, Routing, find_banks, load, read_routing, write_bank
from calib.bank.schema import KEYS
from calib.bank.stats import compute_stats
from calib.bank.validate import BankError, Problem, check, validate

__all__ = ["KEYS", "Bank", "BankError", "Problem", "Routing", "check", "compute_stats", "find_banks", "load",
           "read_routing", "validate", "write_bank"]
