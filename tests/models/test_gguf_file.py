"""The header reader agrees with gguf.GGUFReader and refuses broken files clearly."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from talaria.config.schema import SyntheticShape
from talaria.models.gguf_file import GgufFile, GgufFormatError

from .conftest import write_toy_gguf


def test_reads_like_gguf_reader(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 64)).astype(np.float32),
               "q8": rng.standard_normal((4, 64)).astype(np.float32),
               "q4": rng.standard_normal((2, 3, 64)).astype(np.float32)}
    writer = GGUFWriter(tmp_path / "q.gguf", arch="llama")
    writer.add_token_list(["a", "b"])
    writer.add_token_merges(["a b"])
    writer.add_tensor("f32", tensors["f32"])
    for name, kind in (("q8", GGMLQuantizationType.Q8_0), ("q4", GGMLQuantizationType.Q4_1)):
        writer.add_tensor(name, quantize(tensors[name], kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = GgufFile.open(tmp_path / "q.gguf", string_arrays={"tokenizer.ggml.tokens"})
    reference = GGUFReader(tmp_path / "q.gguf")
    assert ours.metadata["tokenizer.ggml.tokens"] == ["a", "b"] and ours.architecture == "llama"
    assert "tokenizer.ggml.merges" not in ours.metadata and ours.lengths["tokenizer.ggml.merges"] == 1
    for t in reference.tensors:
        got = ours.read(t.name)
        assert got.shape == tensors[t.name].shape and got.flags.writeable
        np.testing.assert_array_equal(got.reshape(-1, 64), dequantize(t.data, t.tensor_type).reshape(-1, 64))
        np.testing.assert_allclose(got, tensors[t.name], atol=0.3)  # quantization error only


def test_reads_smollm2_header_fast(smollm_gguf):
    ours = GgufFile.open(smollm_gguf)
    assert ours.metadata["llama.block_count"] == 30 and ours.lengths["tokenizer.ggml.tokens"] == 49152
    assert ours.tensors["blk.0.attn_q.weight"].ggml_type is GGMLQuantizationType.Q4_1
    assert ours.tensors["token_embd.weight"].shape == (49152, 576)


def test_truncated_file_is_a_format_error(tmp_path):
    write_toy_gguf(tmp_path / "toy.gguf", SyntheticShape())
    data = (tmp_path / "toy.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    cut = GgufFile.open(tmp_path / "cut.gguf")
    with pytest.raises(GgufFormatError, match="runs past the end"):
        cut.read("output.weight")
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(GgufFormatError, match="corrupt or truncated"):
        GgufFile.open(tmp_path / "head.gguf")


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all"])
def test_non_gguf_is_a_format_error(tmp_path, content):
    (tmp_path / "x.gguf").write_bytes(content)
    with pytest.raises(GgufFormatError, match="x.gguf"):
        GgufFile.open(tmp_path / "x.gguf")
