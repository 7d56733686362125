"""A verl user's GSM8K multi-turn job, written the way verl's docs and examples write one, with only
``verl`` renamed: tool, interaction and agent-loop classes, configs, and rows as verl's preprocessing
scripts write them. ``tests/test_verl_dropin.py`` runs it."""
