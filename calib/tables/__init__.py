"""Exported calibration tables: the interface between training and serving (see io and layout)."""

from calib.tables.io import SCHEMA_VERSION, Tables, TablesError, load, save
from calib.tables.layout import AcceptanceTables, GridTables, model_grid_lookup, ngram_grid_lookup

__all__ = ["SCHEMA_VERSION", "AcceptanceTables", "GridTables", "Tables", "TablesError", "load",
           "model_grid_lookup", "ngram_grid_lookup", "save"]
