"""`disk.write_tensors`: a safetensors file written tensor by tensor reads back exactly (every dtype a store or
an export holds, empty tensors, non-contiguous views, metadata) through safetensors itself."""

import torch
from safetensors import safe_open

from moecompress.disk import read_header, write_tensors


def test_written_tensors_read_back_exactly_through_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.f32": torch.randn(4, 4, generator=g).T,  # a non-contiguous view
        "c.f64": torch.randn(2, 3, 3, generator=g, dtype=torch.float64),
        "d.i64": torch.arange(7),
        "e.bool": torch.tensor([True, False, True]),
        "f.empty": torch.zeros(0, 8, 8),
        "g.i8": torch.tensor([-3, 0, 5], dtype=torch.int8),
    }
    path = tmp_path / "t.safetensors"
    write_tensors(path, tensors, metadata={"format": "x/1"})
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata() == {"format": "x/1"}
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k
    assert sorted(read_header(path)) == sorted(tensors)  # moecompress's own header reader agrees
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(8), "little") % 8 == 0  # the data starts aligned
