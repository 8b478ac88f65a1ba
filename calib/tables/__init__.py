"""Exported calibration tables: the interface between training and serving (see io and layout)."""

from calib.tables.io import SCHEMA_VERSION, Tables, TablesError, TablesWarning, load, save
from calib.tables.layout import AcceptanceTables, ChainTable, GridTables, chain_lookup

__all__ = ["SCHEMA_VERSION", "AcceptanceTables", "ChainTable", "GridTables", "Tables", "TablesError",
           "TablesWarning", "chain_lookup", "load", "save"]
