"""The tables the allocator reads: layout and lookups live in :mod:`calib.tables.layout`."""

from calib.tables.layout import AcceptanceTables, GridTables, model_grid_lookup, ngram_grid_lookup

__all__ = ["AcceptanceTables", "GridTables", "model_grid_lookup", "ngram_grid_lookup"]
