"""A handler whose ``predict`` answers ``b"str"`` with a str (not bytes), anything else with its bytes."""


def load(ctx):
    return None


def predict(_model, batch):
    return [p.decode() if p == b"str" else p for p in batch]
