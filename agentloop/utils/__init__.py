"""Helpers under the paths verl's user code imports them from (``verl.utils.*`` with the package renamed)."""
