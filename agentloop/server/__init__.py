"""Rollout servers: one Ray actor per data-parallel rank, each hosting one inference engine."""
