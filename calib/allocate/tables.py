"""The tables the allocator reads: layout and lookups live in :mod:`calib.tables.layout`."""

from calib.tables.layout import AcceptanceTables, ChainTable, GridTables, chain_lookup

__all__ = ["AcceptanceTables", "ChainTable", "GridTables", "chain_lookup"]
