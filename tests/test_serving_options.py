"""The settings of the Ray Serve deployment (``serve run ... key=value``): typed, checked, named on error."""

from __future__ import annotations

import pytest

from tapllm.serving.options import RayServeOptions


def test_serve_run_arguments_are_typed_by_their_field():
    o = RayServeOptions.from_strings({"model": "/m/tiny", "num_replicas": "2", "cpus_per_replica": "8",
                                      "dtype": "float32", "enable_hidden_states": "true", "max_model_len": "none",
                                      "block_size": "32", "served_model_name": "tiny"})
    assert (o.num_replicas, o.cpus_per_replica, o.torch_threads, o.block_size, o.model_name) == (2, 8.0, 8, 32, "tiny")
    cfg = o.engine_config()
    assert cfg.enable_hidden_states is True and cfg.max_model_len is None and cfg.dtype == "float32"
    assert cfg.enable_steering is False  # tapllm serve's default for a shared service
    assert RayServeOptions("/m/model.gguf").model_name == "model"


@pytest.mark.parametrize("args, message", [
    ({"num_replicas": "2"}, "model is required"),
    ({"model": "/m", "colour": "red"}, "unknown setting 'colour'"),
    ({"model": "/m", "num_replicas": "0"}, "num_replicas must be an integer >= 1"),
    ({"model": "/m", "cpus_per_replica": "-1"}, "cpus_per_replica must be > 0"),
    ({"model": "/m", "enable_hidden_states": "maybe"}, "enable_hidden_states must be true or false"),
    ({"model": "/m", "max_num_seqs": "many"}, "max_num_seqs must be an integer"),
    ({"model": "/m", "block_size": "0"}, "block_size must be >= 1"),
])
def test_bad_settings_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        RayServeOptions.from_strings(args)


def test_an_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="api_key is empty"):
        RayServeOptions("/m", api_key=" ")
