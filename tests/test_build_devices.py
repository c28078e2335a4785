"""Building a model under ``torch.device(...)`` never mixes devices, for every family.

Each family is built on the ``meta`` device (shapes only, no memory): any buffer computed on
the CPU and combined with one made on the target device, as a Llama-3 rope table once was,
raises there, and every parameter and buffer must end on the target device.
"""

from __future__ import annotations

import pytest
import torch

from family_configs import family_configs
from tapllm.config import ModelConfig
from tapllm.models import build_model


@pytest.mark.parametrize("name", sorted(family_configs()))
def test_every_family_builds_on_the_device_in_force(tmp_path, name):
    family_configs()[name].save_pretrained(tmp_path)
    config = ModelConfig.from_folder(tmp_path, "float32", torch.device("cpu"))
    with torch.device("meta"):
        model = build_model(config)
    placed = {n: t.device.type for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert placed and set(placed.values()) == {"meta"}, {n: d for n, d in placed.items() if d != "meta"}
