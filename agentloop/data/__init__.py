"""Datasets built here (no downloads): synthetic tasks in verl's row format."""
