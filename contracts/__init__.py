"""Dilu's typed events, subjects and codec. Imports nothing else of Dilu."""
from . import events, subjects
from .codec import MalformedEvent, decode, encode

__all__ = ["events", "subjects", "encode", "decode", "MalformedEvent"]
