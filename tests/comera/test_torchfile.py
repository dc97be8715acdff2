"""comera.torchfile: a file that is not a torch file is named as such from its first bytes
(torch's own error for a text file is a bare ``IndexError``), and peeking says what a file holds
without running any of it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera.torchfile import (
    NotATorchFileError,
    load_error_reason,
    peek_torch_file,
    read_torch_file,
    write_torch_file,
)


@pytest.mark.parametrize(("data", "said"), [
    (b"", "it is empty (0 bytes)"),
    (b"root:x:0:0:root:/root:/bin/bash\n", "it begins with b'root:x:0:0:root:'"),
    (b"\x00" * 64, "it begins with b'\\x00"),
])
def test_a_file_that_is_not_a_torch_file_says_so(tmp_path, data, said):
    path = tmp_path / "f.pt"
    path.write_bytes(data)
    with pytest.raises(NotATorchFileError, match="not a torch file") as info:
        read_torch_file(path)
    assert said in str(info.value)
    assert isinstance(info.value, ValueError)
    assert load_error_reason(info.value).startswith("NotATorchFileError: not a torch file")
    assert peek_torch_file(path) == ("unreadable", load_error_reason(info.value))


def test_torch_files_of_both_formats_still_read(tmp_path):
    for zipped in (True, False):
        path = tmp_path / f"t{zipped}.pt"
        torch.save({"x": torch.arange(3)}, path, _use_new_zipfile_serialization=zipped)
        assert torch.equal(read_torch_file(path)["x"], torch.arange(3))
    write_torch_file(tmp_path / "w.pt", [1, 2])
    assert read_torch_file(tmp_path / "w.pt") == [1, 2]


def test_peek_names_data_and_pickled_objects_without_running_them(tmp_path):
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "state.pt")
    kind, state = peek_torch_file(tmp_path / "state.pt")
    assert kind == "data" and set(state) == {"weight", "bias"}
    torch.save(nn.Linear(2, 2), tmp_path / "model.pt")
    assert peek_torch_file(tmp_path / "model.pt") == ("object", "torch.nn.modules.linear.Linear")
