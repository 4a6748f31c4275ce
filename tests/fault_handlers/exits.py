"""A handler whose load ends the process with exit code 3, printing nothing: a crash, not a load error."""
import os


def load(ctx):
    os._exit(3)


def predict(_model, batch):
    return batch
