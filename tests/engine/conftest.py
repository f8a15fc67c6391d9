"""The `engines` fixture: started engines over FakeModel (or a given model), shut down after; a
model with a clock (FakeModel's) times the engine's passes."""

from __future__ import annotations

import pytest
from engine_harness import TOKENIZER
from fake_model import FakeModel

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.engine import ContinuousBatchEngine


@pytest.fixture
def engines():
    """engines(model=None, **config) → a started engine; all are shut down after the test."""
    created = []

    def create(model=None, start=True, **config):
        config = {"ctx": 1024, "block_size": 8, **config}
        model = model or FakeModel()
        engine = ContinuousBatchEngine(model, TOKENIZER, EngineConfig(**config))
        engine.runner.clock = getattr(model, "clock", None) or engine.runner.clock
        created.append(engine)
        if start:
            engine.start()
        return engine

    yield create
    for engine in created:
        engine.shutdown(wait=True)
