"""A trajectory viewer in the browser: ``python -m agentloop.viewer RUN_DIR`` (see ``__main__``)."""
