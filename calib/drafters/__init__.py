"""Recipes for drafters used to produce banks (not used at serve time by calib itself)."""
