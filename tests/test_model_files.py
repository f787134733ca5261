"""Reading a model's parameters straight from its safetensors files (``training.model.read_parameters``):
what a shadow starts from without importing ``transformers``; it must equal the loaded model bitwise."""

from __future__ import annotations

import pytest

from raycheck.training.model import default_cache_dir, load_model, model_dir, parameter_layout, read_parameters, trainable_parameters
from raycheck.training.state import state_sha256


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_parameters_read_from_the_files_equal_the_loaded_models_bitwise(dtype):
    loaded = trainable_parameters(load_model("tiny", default_cache_dir(), dtype=dtype))
    read = read_parameters(model_dir("tiny", default_cache_dir()), parameter_layout(loaded), dtype)
    assert read is not None and list(read) == list(loaded)  # the same names, in named_parameters order
    assert state_sha256(read) == state_sha256(loaded)
    assert all(r.dtype == p.dtype and r.shape == p.shape for r, p in zip(read.values(), loaded.values()))


def test_a_layout_the_files_do_not_hold_is_left_to_the_model_loader():
    folder = model_dir("tiny", default_cache_dir())
    layout = parameter_layout(trainable_parameters(load_model("tiny", default_cache_dir())))
    assert read_parameters(folder, [*layout, ["lm_head.extra", [4], "float32"]]) is None  # a name not in the files
    name, shape, dtype = layout[0]
    assert read_parameters(folder, [[name, [shape[0] + 1, *shape[1:]], dtype], *layout[1:]]) is None  # another shape
    assert read_parameters(folder, layout, "bfloat16") is None  # the layout says float32
