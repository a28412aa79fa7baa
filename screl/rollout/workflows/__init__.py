"""Rollout workflows: what a worker does with one sibling (:mod:`.workflow`'s single turn, :mod:`.multiturn`,
:mod:`.agent`), the chat prompts and trajectories they build rows from, and the run's reward shaping. They drive
an engine through the worker's ``generate``; they never import the server."""
