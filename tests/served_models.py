"""The [[models]] entry of a small synthetic model, as TOML, for a config that a test or a benchmark serves.

Only the standard library and tomli_w, so a bench script imports it without torch or pytest:
bench/router.py serves the same tiny-llama as tests/test_lifecycle.py."""

from __future__ import annotations

import tomli_w

# the shape of the default config's tiny models (talaria.toml): generated and started in seconds
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
         "vocab_size": 512, "max_position": 2048}


def synthetic_model_toml(name: str, family: str, seed: int, *, tie_word_embeddings: bool) -> str:
    """A float32 synthetic `family` model of SHAPE, its weights drawn from `seed`."""
    shape = {"family": family, **SHAPE, "tie_word_embeddings": tie_word_embeddings}
    return tomli_w.dumps({"models": [{"name": name, "source": "synthetic:", "dtype": "float32", "seed": seed,
                                      "shape": shape}]})
