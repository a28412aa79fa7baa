"""Custom samplers used by the config tests (importable as ``sampler_plugins:ClassName``)."""

from __future__ import annotations

from screl.data.samplers import InOrderSampler


class DeclaresCheckpoint(InOrderSampler):
    """A custom sampler that declares both capabilities on its own class."""

    supports_buffer_checkpoint = True
    supports_training_claims = True


class InheritsCheckpoint(InOrderSampler):
    """Declares nothing itself: the built-in's inherited True must not count."""


class NoClaims(InOrderSampler):
    """Restores buffered groups but cannot hold training claims."""

    supports_buffer_checkpoint = True
    supports_training_claims = False


class NoReplay(InOrderSampler):
    """Declares that it cannot restore buffered groups: its checkpoints are written in shadow mode."""

    supports_buffer_checkpoint = False
    supports_training_claims = False
